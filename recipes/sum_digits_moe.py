"""sum_digits_moe: the sum_digits demo on a randomly initialized tiny Qwen3-MoE.

The model is `qwen3_moe/tiny`: the dense tiny shape with every feed-forward a softmax top-2
router over 8 SwiGLU experts of width 128. The run is `sum_digits`'s (an SFT warm-up, then
GRPO) with the router's load-balancing loss in the objective, at the weight the model's config
gives it (0.001, as in the released Qwen3-MoE configs). Trained from scratch without it, the
routers send most tokens to a few experts: `moe/aux_loss` climbs from 2.0 (top-k: even use)
to 3.4 by the end of the run; with it, it stays near 2.0. The router metrics are logged every
step and drawn in plots/router.png.
"""

from __future__ import annotations

from recipes.sum_digits import sum_digits
from temper.config.recipes import recipe
from temper.rl.job import RLJob


@recipe("SFT warm-up then GRPO on sum-of-digits, tiny Qwen3-MoE from scratch (~2 min on CPU)")
def sum_digits_moe() -> RLJob.Config:
    config = sum_digits()
    config.model.base_model = "qwen3_moe/tiny"
    config.trainer.router_aux_loss = "add"
    return config
