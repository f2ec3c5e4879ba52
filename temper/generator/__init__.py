"""Generator services: what stands between the clients and a decode engine.

The `Generator` seam (seam.py) and `GeneratorChoice` (choice.py); the backends behind the seam
(Temper's engine from temper/sampler/, vLLM in vllm.py); many LoRA adapters on one engine
(multi_lora.py on Temper's, whose calls join the engine's running batch; vllm_lora.py on
vLLM's, call_batches.py batching its callers);
and the disaggregated pieces: a trainer's handle on generator ranks (remote.py) and the loop
those ranks run (generator_rank.py).
"""
