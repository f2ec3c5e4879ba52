"""One Gated DeltaNet layer, forward + backward on a full sequence: Temper's against
transformers' `Qwen3_5GatedDeltaNet` (its pure-PyTorch chunked path) on the identical config
and weights.

Case: width 256, 2 key heads and 4 value heads of 64, conv kernel 4, 2,048 tokens, batch 1,
fp32 on CPU (or --device cuda --dtype bfloat16). The backward is of sum(out^2) with respect
to the input and every weight. Rounds alternate the sides; medians. The same is timed for the
gated delta rule alone (chunked form, the layer's q, k, v, g and beta shapes), to show how much
of the layer is the rule and how much the projections, conv and norms both sides share. Where
flash-linear-attention's kernels apply (CUDA, bf16/fp16, installed), Temper's layer is timed
with its speed wing too (fla_kernels.py). Prints one JSON line with the config, the times, the
speedups and the largest output difference.

    OMP_WAIT_POLICY=PASSIVE python bench/gated_deltanet.py [--tokens 2048] [--device cpu]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import interleaved_median_seconds, require_baseline

from temper.models.build import parse_dtype
from temper.models.common.delta_rule import chunk_gated_delta_rule
from temper.models.common.fla_kernels import FlaKernels, load_fla_kernels
from temper.models.common.gated_deltanet import GatedDeltaNet

CONFIG = {
    "dim": 256,
    "num_key_heads": 2,
    "num_value_heads": 4,
    "key_head_dim": 64,
    "value_head_dim": 64,
    "conv_kernel": 4,
}


def _layers(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    hf_config = Qwen3_5TextConfig(
        hidden_size=CONFIG["dim"],
        linear_num_key_heads=CONFIG["num_key_heads"],
        linear_num_value_heads=CONFIG["num_value_heads"],
        linear_key_head_dim=CONFIG["key_head_dim"],
        linear_value_head_dim=CONFIG["value_head_dim"],
        linear_conv_kernel_dim=CONFIG["conv_kernel"],
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    hf_layer = Qwen3_5GatedDeltaNet(hf_config, layer_idx=0)
    with torch.no_grad():
        for name, param in hf_layer.named_parameters():
            if name == "A_log":
                param.uniform_(0.01, 16.0).log_()
            elif name.endswith("norm.weight") or name == "dt_bias":
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    ours = GatedDeltaNet(layer_index=0, norm_eps=1e-6, **CONFIG)
    state = {
        key.replace("conv1d.weight", "conv_weight"): v for key, v in hf_layer.state_dict().items()
    }
    ours.load_state_dict(state)
    return hf_layer.to(device, dtype), ours.to(device, dtype)


def _rule_seconds(
    *, tokens: int, repeats: int, device: torch.device, dtype: torch.dtype
) -> dict[str, float]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    generator = torch.Generator(device=device).manual_seed(1)
    N, K, V = CONFIG["num_value_heads"], CONFIG["key_head_dim"], CONFIG["value_head_dim"]
    shapes = [
        (1, tokens, N, K),
        (1, tokens, N, K),
        (1, tokens, N, V),
        (1, tokens, N),
        (1, tokens, N),
    ]
    q, k, v, a, b = (torch.randn(s, device=device, generator=generator).to(dtype) for s in shapes)
    g, beta = -torch.nn.functional.softplus(a), b.sigmoid()
    leaves = [t.requires_grad_() for t in (q, k, v, g.detach(), beta.detach())]

    def ours() -> None:
        out, _ = chunk_gated_delta_rule(*leaves, state_BNKV=None)
        out.square().sum().backward()

    def reference() -> None:
        out, _ = torch_chunk_gated_delta_rule(
            *leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm_in_kernel=True
        )
        out.square().sum().backward()

    return interleaved_median_seconds(
        {"temper": ours, "transformers": reference}, repeats=repeats, device=device
    )


def run(
    *, tokens: int = 2048, device: str = "cpu", dtype: str = "float32", repeats: int = 5
) -> dict:
    """The bench's JSON fields (gpu_check.py runs it on CUDA in bf16)."""
    device, torch_dtype = torch.device(device), parse_dtype(dtype)
    hf_layer, ours = _layers(device, torch_dtype)
    x_BTD = torch.randn(1, tokens, CONFIG["dim"], device=device, dtype=torch_dtype)
    x_BTD.requires_grad_()
    sides = {"temper": ours, "transformers": hf_layer}
    kernels = load_fla_kernels("auto")
    if kernels is not None and FlaKernels.applies(x_BTD):
        wing = GatedDeltaNet(layer_index=0, norm_eps=1e-6, kernels=kernels, **CONFIG)
        wing.load_state_dict(ours.state_dict())
        sides["temper_fla"] = wing.to(device, torch_dtype)

    def step(layer: torch.nn.Module) -> None:
        layer(x_BTD).float().square().sum().backward()

    with torch.no_grad():
        max_diff = (hf_layer(x_BTD) - ours(x_BTD)).abs().max().item()
    seconds = interleaved_median_seconds(
        {name: (lambda layer=layer: step(layer)) for name, layer in sides.items()},
        repeats=repeats,
        device=device,
    )
    rule = _rule_seconds(tokens=tokens, repeats=repeats, device=device, dtype=torch_dtype)
    found = {
        "bench": "gated_deltanet_forward_backward",
        "config": {**CONFIG, "tokens": tokens, "batch": 1, "dtype": dtype},
        "device": str(device),
        "threads": torch.get_num_threads(),
        **{f"{name}_s": round(value, 4) for name, value in seconds.items()},
        "speedup": round(seconds["transformers"] / seconds["temper"], 2),
        "rule_temper_s": round(rule["temper"], 4),
        "rule_transformers_s": round(rule["transformers"], 4),
        "rule_speedup": round(rule["transformers"] / rule["temper"], 2),
        "max_abs_output_diff": max_diff,
    }
    if "temper_fla" in seconds:
        found["fla_speedup"] = round(seconds["transformers"] / seconds["temper_fla"], 2)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    require_baseline("transformers")
    found = run(tokens=args.tokens, device=args.device, dtype=args.dtype, repeats=args.repeats)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
