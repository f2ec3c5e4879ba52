"""The memory plan against real tensors: the tiny model's weights, AdamW state and gradients
(in one process and as FSDP shards on 2 gloo ranks), the sampler's copy and KV cache, the
tensors autograd saves, and the whole-weights sync; then the relations between
placements, the estimated rows of a process (its NCCL communicators, graph pools) and the
errors for bad settings."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from temper.checkpoint.gather import sampler_state_dict
from temper.client.sampler_weights import sampler_model
from temper.distributed.parallel_dims import ParallelDims
from temper.job.memory_plan import (
    ModelShapes,
    PlanSettings,
    activation_bytes,
    model_config,
    plan_memory,
)
from temper.job.runtime_bytes import (
    CUDA_CONTEXT_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    graph_pool_bytes,
    nccl_communicators,
)
from temper.models import materialize
from temper.models.lora import apply_lora
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.trainer import LoraConfig, TrainerEngine
from tests.distributed import training
from tests.distributed.spawn import spawn

LORA_RANK = 3  # odd: FSDP pads the adapters' A matrices on 2 ranks


def _settings(**changes) -> PlanSettings:
    base = {"model": "tiny", "nproc_per_node": 1, "batch": 4, "max_seq_len": 64}
    return PlanSettings(**{**base, **changes})


def _rows(plan, role: str = "colocated") -> dict[str, int]:
    """Bytes by item name (the text before the first comma or colon)."""
    rows = plan.role(role).rows
    return {row.item.split(",")[0].split(":")[0]: row.num_bytes for row in rows}


def _nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind the (local) tensors, each counted once: FSDP's padded
    shards, and the buffers its sharded gradients are views of."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _trained_bytes(engine) -> dict[str, int]:
    """What a trainer holds: weights, gradients after forward_backward, AdamW moments after
    optim_step."""
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    share = slice(engine.sharding.dp_rank, None, 2) if engine.sharding else slice(None)
    engine.forward_backward(training.batch(0)[share], "cross_entropy")
    gradients = _storage_bytes(p.grad for p in trainable)
    engine.optim_step(training.ADAM)
    state = engine.optimizer.torch_optimizer.state
    moments = [state[p][key] for p in trainable for key in ("exp_avg", "exp_avg_sq")]
    return {
        "frozen": _storage_bytes(frozen),
        "trainable": _storage_bytes(trainable),
        "gradients": gradients,
        "moments": _storage_bytes(moments),
    }


@pytest.mark.parametrize("lora_rank", [None, LORA_RANK])
def test_one_process_plan_matches_the_trainer_and_sampler_tensors(lora_rank):
    lora = None if lora_rank is None else LoraConfig(rank=lora_rank)
    engine = training.engine(lora=lora)
    plan = plan_memory(_settings(lora_rank=lora_rank, dtype="float32"), decoder=engine.model.config)
    rows = _rows(plan)
    sampler_bytes = _nbytes(sampler_model(engine.model, lora=lora).parameters())
    held = _trained_bytes(engine)
    if lora is None:
        assert rows["weights"] == held["trainable"]
        # Full fine-tuning in one process: the sampler reads the trainer's tensors.
        assert rows["generator weights"] == 0
    else:
        assert rows["base weights (frozen)"] == held["frozen"]
        assert rows["LoRA adapters"] == held["trainable"]
        # The merged copy of a tied model is untied: one more [V, D] matrix.
        assert rows["generator weights"] == sampler_bytes
    assert rows["gradients"] == held["gradients"]
    assert rows["AdamW moments (2)"] == held["moments"]


def test_a_bf16_mixed_plan_counts_fp32_state_and_a_bf16_generator_copy():
    engine = TrainerEngine.Config().build(
        model=training.tiny_model(), lora=None, compute_dtype=torch.bfloat16
    )
    plan = plan_memory(_settings(dtype="bf16-mixed"), decoder=engine.model.config)
    rows = _rows(plan)
    held = _trained_bytes(engine)
    generator = sampler_model(engine.model, lora=None, dtype=engine.compute_dtype)
    assert rows["weights"] == held["trainable"] == 4 * engine.model.config.num_params
    assert rows["gradients"] == held["gradients"]
    assert rows["AdamW moments (2)"] == held["moments"]
    assert rows["generator weights"] == _nbytes(generator.parameters()) == held["trainable"] // 2
    # Autocast keeps a bf16 cast of the weights for backward (FSDP's casts when sharded).
    assert rows["autocast"] == held["trainable"] // 2
    assert "FSDP gathered" not in rows
    sharded = _rows(plan_memory(_settings(dtype="bf16-mixed", nproc_per_node=2)))
    assert "autocast" not in sharded
    assert sharded["FSDP gradient reduction in float32"] > 0
    pure = _rows(plan_memory(_settings(dtype="bfloat16", nproc_per_node=2)))
    assert sharded["FSDP gathered"] == pure["FSDP gathered"]  # gathered in bf16 either way
    assert sharded["weights"] == 2 * pure["weights"]  # fp32 master shards


def test_a_bf16_mixed_lora_plan_keeps_the_base_in_bf16_and_the_adapters_in_fp32():
    engine = TrainerEngine.Config().build(
        model=training.tiny_model().to(torch.bfloat16),
        lora=LoraConfig(rank=LORA_RANK),
        compute_dtype=torch.bfloat16,
    )
    settings = _settings(dtype="bf16-mixed", lora_rank=LORA_RANK)
    rows = _rows(plan_memory(settings, decoder=engine.model.config))
    held = _trained_bytes(engine)
    generator = sampler_model(engine.model, lora=engine.lora, dtype=engine.compute_dtype)
    assert rows["base weights (frozen)"] == held["frozen"]  # bf16: no master copy
    assert rows["LoRA adapters"] == held["trainable"]  # fp32
    assert rows["gradients"] == held["gradients"]
    assert rows["AdamW moments (2)"] == held["moments"]
    assert rows["generator weights"] == _nbytes(generator.parameters())
    assert rows["autocast"] == held["trainable"] // 2  # only the fp32 adapters are cast


def test_auto_plans_a_gpu_default():
    assert PlanSettings(model="tiny", dtype="auto").dtype == "bf16-mixed"


def _held_bytes(rank: int, dims: ParallelDims.Config) -> dict[str, int]:
    engine = training.engine(dims=dims, lora=LoraConfig(rank=LORA_RANK))
    held = _trained_bytes(engine)
    del engine
    return held


def test_fsdp_shards_on_two_ranks_match_the_plan(tmp_path):
    dims = ParallelDims.Config(dp_shard=2)
    ranks = spawn(_held_bytes, world_size=2, out_dir=tmp_path, args=(dims,))
    config = training.tiny_model().config
    plan = plan_memory(
        _settings(nproc_per_node=2, lora_rank=LORA_RANK, dtype="float32"), decoder=config
    )
    rows = _rows(plan)
    # The plan is of the rank holding the most (FSDP gives the first ranks ceil(dim0 / 2) rows).
    largest = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    assert rows["base weights (frozen)"] == largest["frozen"]
    assert rows["LoRA adapters"] == largest["trainable"]
    assert rows["gradients"] == largest["gradients"]
    assert rows["AdamW moments (2)"] == largest["moments"]


def test_ddp_on_two_ranks_holds_whole_copies_as_the_plan_says(tmp_path):
    dims = ParallelDims.Config(dp_replicate=2, dp_shard=1)
    ranks = spawn(_held_bytes, world_size=2, out_dir=tmp_path, args=(dims,))
    config = training.tiny_model().config
    settings = _settings(nproc_per_node=2, lora_rank=LORA_RANK, dtype="float32", dp_replicate=2)
    plan = plan_memory(settings, decoder=config)
    rows = _rows(plan)
    assert ranks[0] == ranks[1]
    assert rows["base weights (frozen)"] == ranks[0]["frozen"]
    assert rows["LoRA adapters"] == ranks[0]["trainable"]
    assert rows["AdamW moments (2)"] == ranks[0]["moments"]
    assert "FSDP gathered" not in " ".join(rows)
    assert "each a whole trainer (DDP over 2)" in plan.roles[0].description


@pytest.mark.parametrize(("batch", "max_batch"), [(5, None), (5, 3)])
def test_kv_cache_is_what_the_engine_allocates(batch, max_batch):
    config = training.tiny_model().config
    plan = plan_memory(
        _settings(batch=batch, max_seq_len=96, max_batch=max_batch, dtype="bfloat16"),
        decoder=config,
    )
    model = materialize(config, dtype="bfloat16")
    engine = SamplerEngine.Config(
        max_batch=max_batch or batch, max_seq_len=96, cpu=CpuDecoding.Config(processes=1)
    ).build(model=model)
    assert _rows(plan)["KV cache"] == engine.cache.nbytes


def _saved_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of the tensors autograd keeps for one forward (the weights left out)."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens_BT = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden_BTD = model.hidden_states(tokens_BT)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    del hidden_BTD
    return sum(size for pointer, size in storages.items() if pointer not in weights)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "bf16-mixed"])
@pytest.mark.parametrize("lora", [False, True])
def test_activation_estimate_matches_what_autograd_saves(dtype, lora):
    config = dataclasses.replace(
        training.tiny_model().config, num_layers=3, num_heads=8, num_kv_heads=2, ffn_dim=512
    )
    mixed = dtype == "bf16-mixed"
    # bf16-mixed: fp32 trained weights; a LoRA base stays in bf16, its adapters in fp32.
    model = materialize(config, dtype=("bfloat16" if lora else "float32") if mixed else dtype)
    if lora:
        apply_lora(model, LoraConfig(rank=4))
    if mixed:
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()
    tokens = 128
    estimate = activation_bytes(config, tokens=tokens, dtype=dtype, lora=lora, checkpointing="none")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        saved = _saved_bytes(model, tokens)
        if mixed:  # autocast's bf16 casts of the fp32 weights are saved once, whatever the tokens
            twice = _saved_bytes(model, 2 * tokens)
            casts, saved = 2 * saved - twice, twice - saved
            masters = [
                p for name, p in model.named_parameters() if name.startswith("blocks.") and p.ndim
            ]
            fp32 = sum(p.numel() for p in masters if p.dtype == torch.float32)
            assert casts == pytest.approx(2 * fp32, rel=0.1)
    assert saved == pytest.approx(estimate, rel=0.05)
    checkpointed = activation_bytes(
        config, tokens=tokens, dtype=dtype, lora=lora, checkpointing="full"
    )
    assert checkpointed < estimate


class _LiveBytes(TorchDispatchMode):
    """The peak of bytes held by tensors that ops made while it was on (a CPU stand-in for
    torch.cuda.max_memory_allocated); inputs made before it count only through new copies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr():
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in self._seen:
            return  # a view of a tensor already counted
        size = tensor.untyped_storage().nbytes()
        self._seen.add(pointer)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, pointer, size)

    def _free(self, pointer: int, size: int) -> None:
        self._seen.discard(pointer)
        self.live -= size


def test_whole_sync_holds_what_the_plan_says():
    """The whole sync of a sharded LoRA trainer (sampler_state_dict: gather every tensor, then
    merge) holds the gathered copy, new merged tensors and the merge's fp32 scratch at once."""
    model = training.tiny_model()
    model = materialize(dataclasses.replace(model.config, vocab_size=512), dtype="bfloat16")
    apply_lora(model, LoraConfig(rank=LORA_RANK))
    plan = plan_memory(
        _settings(nproc_per_node=2, lora_rank=LORA_RANK, weight_sync="whole"),
        decoder=model.config,
    )
    sync = sum(row.num_bytes for row in plan.role("colocated").rows if row.phase == "sync")
    with _LiveBytes() as measured:
        merged = sampler_state_dict(model)
    del merged
    assert measured.peak == pytest.approx(sync, rel=0.05)


def test_model_shapes_count_every_parameter():
    config = training.tiny_model().config
    shapes = ModelShapes.of(config, lora_rank=None)
    assert shapes.sampler_numel == config.num_params
    assert shapes.numel(root=True) + config.num_layers * shapes.numel(prefix="blocks.0.") == (
        config.num_params
    )
    lora = ModelShapes.of(config, lora_rank=LORA_RANK)
    # Merging the unembedding adapter into a tied model unties it.
    assert lora.sampler_numel == config.num_params + config.vocab_size * config.dim


# -- placements --------------------------------------------------------------------------


def _big(**changes) -> PlanSettings:
    base = {"model": "8B", "nnodes": 2, "nproc_per_node": 8, "lora_rank": 32}
    return PlanSettings(**{**base, "batch": 256, "max_seq_len": 1024, **changes})


def test_disaggregated_moves_the_generator_off_the_trainer_ranks():
    colocated = plan_memory(_big())
    split = plan_memory(_big(placement="disaggregated", generator_ranks=4))
    everyone, trainer, generator = (
        _rows(colocated),
        _rows(split, "trainer"),
        _rows(split, "generator"),
    )
    # 12 trainer ranks instead of 16: bigger shards; no generator on them.
    assert trainer["base weights (frozen)"] > everyone["base weights (frozen)"]
    assert "generator weights" not in trainer and "KV cache" not in trainer
    # Generators hold whole weights and 4x the sequences of a colocated rank, no trainer.
    assert generator["generator weights"] == everyone["generator weights"]
    assert generator["KV cache"] == 4 * everyone["KV cache"]
    assert "gradients" not in generator
    tp_generator = _rows(
        plan_memory(_big(placement="disaggregated", generator_ranks=4, generator_tp=2)),
        "generator",
    )
    # tp 2: half the weights and half the kv heads, for twice the sequences per engine.
    assert tp_generator["generator weights"] == generator["generator weights"] // 2
    assert tp_generator["KV cache"] == generator["KV cache"]


def test_async_and_kl_reference_each_add_a_sampler():
    base = plan_memory(_big()).role("colocated")
    sampler = _rows(plan_memory(_big()))
    prefix = "prefix cache"
    one_copy = sampler["generator weights"] + sampler["KV cache"] + sampler[prefix]
    assert sampler[prefix] == 32 * 2**20  # the engine's default
    pool = sampler["CUDA graph pool (estimate)"]  # each engine captures its own graphs
    for changes in ({"mode": "async"}, {"kl_reference": True}):
        assert plan_memory(_big(**changes)).role("colocated").steady_bytes == (
            base.steady_bytes + one_copy + pool
        )


def test_overlap_sync_adds_a_copy_of_the_weights_on_each_generator_rank():
    split = {"placement": "disaggregated", "generator_ranks": 4}
    plain, overlap = plan_memory(_big(**split)), plan_memory(_big(**split, overlap_sync=True))
    weights = _rows(plain, "generator")["generator weights"]
    assert _rows(overlap, "generator")["second copy of the weights (overlap_sync)"] == weights
    assert overlap.role("generator").steady_bytes == plain.role("generator").steady_bytes + weights
    assert overlap.role("trainer") == plain.role("trainer")


def test_a_disaggregated_kl_reference_sits_on_the_generator_ranks_without_a_kv_cache():
    """The generator ranks load the KL reference as whole weights that only score."""
    split = {"placement": "disaggregated", "generator_ranks": 4}
    plain, with_kl = plan_memory(_big(**split)), plan_memory(_big(**split, kl_reference=True))
    assert with_kl.role("trainer") == plain.role("trainer")
    reference = _rows(with_kl, "generator")["KL reference weights"]
    assert reference == _rows(plain, "generator")["generator weights"]
    assert (
        with_kl.role("generator").steady_bytes == plain.role("generator").steady_bytes + reference
    )


def test_bucketed_sync_holds_two_buckets_instead_of_whole_copies():
    bucketed = plan_memory(_big(model="0.6B", lora_rank=None, bucket_mb=1024))
    whole = plan_memory(_big(model="0.6B", lora_rank=None, weight_sync="whole"))
    assert _rows(bucketed)["weight-sync buffers"] == 2 * 1024 * 2**20
    assert _rows(whole)["gathered whole weights"] == 2 * whole.num_params
    # A tensor larger than a bucket is split by rows: the buffers stay two buckets.
    small = _rows(plan_memory(_big(model="0.6B", lora_rank=None, bucket_mb=1)))
    assert small["weight-sync buffers"] == 2 * 2**20
    # A model smaller than a bucket never fills one.
    tiny = plan_memory(_big(model="tiny", lora_rank=None, max_seq_len=64))
    assert _rows(tiny)["weight-sync buffers"] == 2 * tiny.num_params * 2  # bf16


def test_colocated_8b_lora_with_256_slots_per_rank_holds_about_56_gb():
    """The back-of-envelope in docs/distributed.md: 8B LoRA on 16 GPUs, each engine with 256
    slots x 1024, about 56 GB steady in tensors; the process (a CUDA context, the default
    group's NCCL buffers, the engine's graph pool) adds about 1 GB."""
    plan = plan_memory(_big(max_batch=256))
    process = CUDA_CONTEXT_BYTES + NCCL_COMMUNICATOR_BYTES
    process += graph_pool_bytes(model_config("8B"), num_slots=256, dtype="bfloat16")
    tensors = plan.role("colocated").steady_bytes - process
    assert tensors / 1e9 == pytest.approx(56, abs=1)
    assert process / 1e9 == pytest.approx(1.05, abs=0.01)


def _communicators(plan, role: str) -> int:
    rows = _rows(plan, role)
    assert rows["CUDA context (estimate)"] == CUDA_CONTEXT_BYTES  # one per process
    nccl = rows.get("NCCL buffers (estimate)", 0)
    assert nccl % NCCL_COMMUNICATOR_BYTES == 0
    return nccl // NCCL_COMMUNICATOR_BYTES


def test_each_rank_counts_the_nccl_communicators_it_takes_part_in():
    # One process: no process group. Colocated FSDP or DDP over the world: its mesh groups
    # span the world, so they are the default group; hybrid adds its two dimensions.
    assert _communicators(plan_memory(_settings()), "colocated") == 0
    assert _communicators(plan_memory(_big()), "colocated") == 1
    assert _communicators(plan_memory(_big(dp_replicate=16)), "colocated") == 1
    assert _communicators(plan_memory(_big(dp_replicate=2)), "colocated") == 3
    assert nccl_communicators("colocated", world_size=16, trainer_ranks=16, dp_replicate=2) == (
        "default",
        "mesh dp_replicate",
        "mesh dp_shard",
    )
    # Disaggregated, 12 trainer ranks: the default group, the trainers', the mesh's dp_shard
    # and flattened dp (neither spans the world), its weight channel; a generator rank: the
    # default group and the 12 weight channels.
    split = {"placement": "disaggregated", "generator_ranks": 4}
    assert _communicators(plan_memory(_big(**split)), "trainer") == 5
    assert _communicators(plan_memory(_big(**split, dp_replicate=2)), "trainer") == 6
    assert _communicators(plan_memory(_big(**split)), "generator") == 13
    # One trainer rank: no trainers' group and no mesh.
    alone = _settings(nproc_per_node=2, placement="disaggregated")
    assert nccl_communicators("trainer", world_size=2, trainer_ranks=1, dp_replicate=1) == (
        "default",
        "weight channel",
    )
    assert _communicators(plan_memory(alone), "trainer") == 2
    assert _communicators(plan_memory(alone), "generator") == 2


def test_each_engine_that_decodes_has_a_graph_pool():
    config = model_config("8B")
    # 16 slots of 8B in bf16: fp32 and bf16 logits, one layer's temporaries.
    pool = 16 * config.vocab_size * (4 + 2)
    pool += 16 * (2 * config.ffn_dim + 4 * config.dim + 3 * config.num_heads * config.head_dim) * 2
    assert graph_pool_bytes(config, num_slots=16, dtype="bfloat16") == pool
    assert _rows(plan_memory(_big()))["CUDA graph pool (estimate)"] == pool
    both = _rows(plan_memory(_big(mode="async", kl_reference=True)))
    assert both["CUDA graph pools (estimate)"] == 3 * pool
    split = {"placement": "disaggregated", "generator_ranks": 4, "max_batch": 16}
    # The disaggregated KL reference only scores; a tensor-parallel engine is vLLM's (eager).
    generator = _rows(plan_memory(_big(**split, kl_reference=True)), "generator")
    assert generator["CUDA graph pool (estimate)"] == pool
    assert "CUDA graph pool (estimate)" not in _rows(plan_memory(_big(**split)), "trainer")
    tp = _rows(plan_memory(_big(**split, generator_tp=2)), "generator")
    assert "CUDA graph pool (estimate)" not in tp


def test_32b_colocated_does_not_fit_and_disaggregated_does():
    settings = {"model": "32B", "activation_checkpointing": "full"}
    assert not plan_memory(_big(**settings)).fits
    split = _big(**settings, placement="disaggregated", generator_ranks=4, generator_tp=2)
    assert plan_memory(split).fits


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model": "3B"}, "model '3B' is neither a model directory nor a named size"),
        ({"placement": "disaggregated", "generator_ranks": 16}, "generator_ranks=16"),
        ({"placement": "disaggregated", "generator_ranks": 0}, "generator_ranks=0"),
        ({"generator_ranks": 4}, "generator_ranks=4"),
        ({"placement": "disaggregated", "generator_ranks": 3, "generator_tp": 2}, "generator_tp"),
        ({"placement": "disaggregated", "generator_ranks": 6, "generator_tp": 3}, "num_heads"),
        ({"placement": "side-by-side"}, "placement"),
        ({"batch": 0}, "batch"),
        ({"lora_rank": 0}, "lora_rank"),
        ({"dtype": "float8"}, "dtype"),
        ({"headroom": 1.0}, "headroom"),
        ({"max_seq_len": 100_000}, "max_seq_len=100000"),
        ({"dp_replicate": 3}, "dp_replicate=3 must divide the 16 trainer ranks"),
    ],
)
def test_bad_settings_name_the_field(changes, field):
    settings = {"model": "tiny", "nproc_per_node": 16, **changes}
    with pytest.raises(ValueError, match=field):
        plan_memory(PlanSettings(**settings))


def test_a_cpu_plan_counts_no_cuda_runtime():
    """A job on CPU logs its plan too: no CUDA context, NCCL buffers or graph pools in it."""
    gpu, cpu = plan_memory(_big()), plan_memory(_big(device="cpu"))
    gpu_items = {row.item for row in gpu.role("colocated").rows}
    cpu_items = {row.item for row in cpu.role("colocated").rows}
    runtime = gpu_items - cpu_items
    assert {item.split(" (")[0].split(":")[0] for item in runtime} == {
        "CUDA context",
        "NCCL buffers",
        "CUDA graph pool",
    }
    dropped = sum(r.num_bytes for r in gpu.role("colocated").rows if r.item in runtime)
    assert gpu.role("colocated").steady_bytes - cpu.role("colocated").steady_bytes == dropped
