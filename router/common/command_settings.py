"""What the settings of every `shoal` command share: a YAML file beneath the environment, and the `--help` listing.

`RouterSettings`, `AutoscalerSettings` and `ReplicaSettings` are `CommandSettings`. Precedence, highest first: the
values passed to the constructor (the command's flags), the environment under the class's `env_prefix` (nested with
`__`), the YAML file named by `config_file` or `<env_prefix>CONFIG_FILE`, defaults. The file is read by
pydantic-settings' `YamlConfigSettingsSource`; one that is missing, unreadable, not YAML or not a mapping is a
ValueError that names it, which each command reports as invalid settings.
"""

from __future__ import annotations

import os
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, YamlConfigSettingsSource


class CommandSettings(BaseSettings):
    """The settings of one `shoal` command (module docstring). A subclass sets `env_prefix` and has a
    `config_file: Path | None` field, so that the file it was loaded from shows in its values."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs: dict[str, Any] = getattr(init_settings, "init_kwargs", {})
        env_name = f"{settings_cls.model_config.get('env_prefix', '')}CONFIG_FILE"
        path = init_kwargs.get("config_file") or os.environ.get(env_name)
        if not path:
            return (init_settings, env_settings)
        if not Path(path).is_file():
            raise ValueError(f"config file {path} does not exist")
        return (init_settings, env_settings, _YamlFile(settings_cls, yaml_file=path))


class _YamlFile(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, refusing by name a file it would report without its name (bad YAML) or merge
    into the settings as if it were a mapping (a list of pairs)."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            data = super()._read_file(file_path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read config file {file_path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {file_path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"config file {file_path} must hold a mapping of settings, not {type(data).__name__}")
        return data


def settings_help(settings_cls: type[BaseSettings]) -> str:
    """Every setting with its environment variable, default and docstring, for `--help`. Nested models are listed
    field by field (`health.interval_s`, SHOAL_ROUTER_HEALTH__INTERVAL_S); a union of models (a policy chosen by
    `kind`) shows its default's kind."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    lines = ["settings (environment variable, default):"]

    def walk(cls: type[BaseModel], path: list[str]) -> None:
        for name, info in cls.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, [*path, name])
                continue
            env = prefix + "__".join(p.upper() for p in [*path, name])
            default = info.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = getattr(default, "kind", type(default).__name__)
            lines.append(f"  {'.'.join([*path, name])}  ({env}, default {default!r})")
            if info.description:
                lines.append("      " + " ".join(info.description.split()))

    walk(settings_cls, [])
    return "\n".join(lines)
