"""Redis URLs (router/service/redis_url.py): the standalone, Sentinel and Cluster forms, and what is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.service.redis_url import RedisTarget, parse_redis_url
from router.service.settings import FleetSettings, RouterSettings


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://:pw@redis:6380/2", "unix:///run/redis.sock"])
def test_standalone_urls_pass_through(url: str) -> None:
    assert parse_redis_url(url) == RedisTarget(url, "standalone")


def test_a_sentinel_url_names_its_sentinels_service_and_database() -> None:
    url = "redis+sentinel://:s%40cret@10.0.0.1:26380,sentinel-b,[::1]:26381/mymaster/3"
    target = parse_redis_url(url)
    assert target == RedisTarget(
        url,
        "sentinel",
        hosts=(("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 26381)),
        service="mymaster",
        db=3,
        password="s@cret",
    )


def test_sentinel_and_cluster_defaults_and_tls() -> None:
    sentinel = parse_redis_url("rediss+sentinel://user:pw@s1:1/primary")
    assert (sentinel.db, sentinel.username, sentinel.password, sentinel.is_tls) == (0, "user", "pw", True)
    cluster = parse_redis_url("redis+cluster://n1:7000,n2")
    assert cluster.kind == "cluster"
    assert cluster.hosts == (("n1", 7000), ("n2", 6379))
    assert not cluster.is_tls
    assert parse_redis_url("rediss+cluster://n1:7000/").is_tls


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("localhost:6379", "no scheme"),
        ("http://localhost:6379", "the scheme must be"),
        ("redis+replica://h:1/x", "the scheme must be"),
        ("redis+sentinel://h1:26379", "names the primary's service"),
        ("redis+sentinel://h1:26379/", "names the primary's service"),
        ("redis+sentinel:///mymaster", "a host is missing"),
        ("redis+sentinel://h1:26379,/mymaster", "a host is missing"),
        ("redis+sentinel://h1:port/mymaster", "bad port 'port'"),
        ("redis+sentinel://h1:70000/mymaster", "bad port '70000'"),
        ("redis+sentinel://h1/mymaster/zero", "database must be a number"),
        ("redis+sentinel://h1/mymaster/0/extra", "/SERVICE[/DB]"),
        ("redis+sentinel://h1/mymaster?db=1", "no query"),
        ("redis+cluster://", "a host is missing"),
        ("redis+cluster://n1:0", "bad port '0'"),
        ("redis+cluster://n1:7000/1", "has no path"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match="redis_url") as info:
        parse_redis_url(url)
    assert problem in str(info.value)


def test_an_error_masks_the_password() -> None:
    with pytest.raises(ValueError) as info:
        parse_redis_url("redis+sentinel://admin:hunter2@h1:26379")
    assert "hunter2" not in str(info.value)
    assert "admin:***@h1:26379" in str(info.value)


def test_settings_refuse_a_bad_url_and_a_namespace_that_breaks_the_hash_tag() -> None:
    assert RouterSettings(redis_url="redis+cluster://n1:7000").redis_url == "redis+cluster://n1:7000"
    with pytest.raises(ValidationError, match="names the primary's service"):
        RouterSettings(redis_url="redis+sentinel://h1:26379")
    with pytest.raises(ValidationError):
        FleetSettings(namespace="a}b")


def test_the_settings_error_for_a_bad_url_shows_no_password() -> None:
    from pydantic import ValidationError

    from router.service.settings import RouterSettings

    with pytest.raises(ValidationError) as info:
        RouterSettings(redis_url="redis+sentinel://admin:hunter2@/primary")
    assert "hunter2" not in str(info.value) and "a host is missing" in str(info.value)
