"""Server memory per extra LoRA session: RSS of `temper serve` as sessions pile up.

Each session creates a LoRA training model, takes one forward_backward + optim_step (and, with
--sample, one sampling snapshot and a sample), and is then abandoned (never closed), as a crashed
client leaves it. Prints the server's RSS after startup, after each session, and the mean marginal
MiB per session. --code-dir runs the server from another source tree (to compare with an older
revision: `git archive <rev> | tar -x -C /tmp/old`).

    PYTHONPATH=$PWD python bench/lora_sessions_memory.py --sessions 4 [--sample] \
        [--dim 512 --layers 8 --ffn-dim 1536]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from temper.observability.process_memory import rss_mib


def write_model(directory: Path, *, dim: int, layers: int, ffn_dim: int) -> None:
    from temper.checkpoint.hf import save_pretrained
    from temper.models.build import materialize
    from temper.models.registry import family
    from temper.tokenizer import build_builtin_tokenizer

    tokenizer = build_builtin_tokenizer("digits")
    tiny = family("qwen3").sizes["tiny"]
    config = dataclasses.replace(
        tiny,
        vocab_size=tokenizer.vocab_size,
        dim=dim,
        num_layers=layers,
        num_heads=max(1, dim // 64),
        num_kv_heads=max(1, dim // 128),
        head_dim=min(64, dim),
        ffn_dim=ffn_dim,
    )
    save_pretrained(
        materialize(config, device="cpu", dtype="float32", seed=0), directory, tokenizer=tokenizer
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=384)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--code-dir", default=os.getcwd())
    args = parser.parse_args()

    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tinker
    from tinker import types

    root = Path(tempfile.mkdtemp(prefix="lora-mem-"))
    model_dir = root / "models" / "bench-model"
    write_model(model_dir, dim=args.dim, layers=args.layers, ffn_dim=args.ffn_dim)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "temper", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--storage", str(root / "storage")]
    env = {**os.environ, "PYTHONPATH": args.code_dir, "OMP_NUM_THREADS": "1"}
    log = (root / "server.log").open("w")
    server = subprocess.Popen(command, cwd=args.code_dir, env=env, stdout=log, stderr=log)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        readings = [rss_mib(server.pid)]
        print(f"startup: {readings[0]:.0f} MiB")
        for index in range(args.sessions):
            service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
            model = service.create_lora_training_client(
                str(model_dir), rank=args.rank, seed=index
            ).result()
            tokenizer = model.get_tokenizer()
            tokens = [*tokenizer.encode("12=3"), tokenizer.eos_token_id]
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
            model.forward_backward([datum], "cross_entropy").result()
            model.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            if args.sample:
                sampler = model.save_weights_and_get_sampling_client().result()
                prompt = types.ModelInput.from_ints(tokenizer.encode("12="))
                params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
                sampler.sample(prompt, num_samples=1, sampling_params=params).result()
            time.sleep(0.5)
            readings.append(rss_mib(server.pid))
            print(
                f"after session {index + 1}: {readings[-1]:.0f} MiB "
                f"(+{readings[-1] - readings[-2]:.0f})"
            )
        # The first session also loads the model code paths; the marginal cost is the rest.
        marginal = (readings[-1] - readings[1]) / max(1, args.sessions - 1)
        print(f"marginal per extra LoRA session: {marginal:.1f} MiB")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
