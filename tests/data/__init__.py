"""Small slices of the public traces, laid out as `shoal simulate fetch-traces` lays out the full ones.

`TRACES_DIR` can stand in for a traces directory (`--traces-dir`, $SHOAL_TRACES_DIR): the packaged scenarios find
their files under it, only shorter. See README.md beside this file for what each slice holds.
"""

from __future__ import annotations

from pathlib import Path

TRACES_DIR = Path(__file__).parent / "traces"
MOONCAKE = TRACES_DIR / "mooncake" / "synthetic_trace.jsonl"
"""The first 400 requests (109 s) of Mooncake's synthetic trace."""
AZURE_CODE = TRACES_DIR / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv"
"""The first 500 rows of the Azure LLM inference 2023 code trace."""
AZURE_CONV = TRACES_DIR / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
"""The first 500 rows of the Azure LLM inference 2023 conversation trace."""
SERVEGEN = TRACES_DIR / "servegen" / "servegen_aggregate_rate.csv"
"""ServeGen aggregate rates: m-large's first two days and deepseek-r1's one day."""
