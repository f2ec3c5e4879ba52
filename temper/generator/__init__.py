"""Generator services: what stands between the clients and a decode engine.

The `Generator` seam (seam.py) and `GeneratorChoice` (choice.py); the backends behind the seam
(Temper's engine from temper/sampler/, vLLM in vllm.py); many LoRA adapters on one engine
(multi_lora.py on Temper's, vllm_lora.py on vLLM's; on both, calls join the engine's running
batch: sampler/decode_loop.py, vllm_steps.py);
and the disaggregated pieces: a trainer's handle on generator ranks (remote.py) and the loop
those ranks run (generator_rank.py).
"""
