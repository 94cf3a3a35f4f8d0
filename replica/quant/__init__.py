"""NVFP4 quantization of the routed experts: 4.5 bits per weight, drop-in for `replica.model.moe.Experts`.

- `nvfp4`: the format itself, `quantize_nvfp4` / `dequantize_nvfp4` (torchao's NVFP4 numerics, bit for bit).
- `experts`: `NVFP4Experts` (W4A16 or W4A4), `quantize_model_experts`, `routed_expert_bytes`.
- `triton_nvfp4`: a Triton dequantize-and-multiply kernel for one expert, with its plain-torch reference.

Importing this package imports nothing; its modules import torch (and Triton, when present).
"""
