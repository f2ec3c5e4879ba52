"""External weights (`save_weights_external`) and the signed URLs that download them.

    <root>/<run>/external_weights/<name>/   a LoRA run: a PEFT adapter directory
                                             (adapter_config.json, adapter_model.safetensors)
                                             plus the tokenizer files;
                                             a full fine-tune: a HF model directory

An export is written from the model's sampler weights (`save_weights_for_sampler` under a
staging name, converted, the staging checkpoint deleted), so it needs no backend verb of its
own and holds what a sampler of the model would load: `peft.PeftModel.from_pretrained` or
`transformers.AutoModelForCausalLM.from_pretrained` reads it.

`tinker checkpoint download` fetches each file with a bare `urllib` GET (no API key), so each
URL carries its own proof instead: an HMAC of the file's path and the URL's expiry under a
key the server draws at start (URLs die with the process; the CLI signs again when its URLs
near expiry). The URLs come only from `external_weights_urls`, which checks the caller's key
and that the caller may read the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from urllib.parse import quote

from safetensors.torch import load_file

from temper.checkpoint.atomic import staged_directory
from temper.checkpoint.peft import save_peft_adapter_tensors
from temper.checkpoint.storage import CheckpointPath
from temper.client.sampler_weights import LORA_FILE, SAMPLER_FILE, resolve_base_model
from temper.models.lora import LoraConfig
from temper.models.registry import family_of_model

URL_TTL_S = 3600
"""How long a download URL stays valid."""
DOWNLOAD_PREFIX = "/api/v1/external_weights_files"
"""Where the files are served (a plain route that checks the URL's signature, not a key)."""


def export_sampler_weights(sampler_dir: Path, target: Path) -> None:
    """Write the external form of the sampler weights in `sampler_dir` to `target` (which must
    not exist), whole or not at all."""
    info = json.loads((sampler_dir / SAMPLER_FILE).read_text())
    with staged_directory(target) as staging:
        for file in sampler_dir.iterdir():
            if file.is_file() and file.name not in (SAMPLER_FILE, LORA_FILE):
                _link_or_copy(file, staging / file.name)
        if info["lora"] is not None:
            _write_peft(sampler_dir / LORA_FILE, staging, info=info)


def _write_peft(adapters_file: Path, staging: Path, *, info: dict) -> None:
    """The LoRA tensors as a PEFT adapter, under the module names of the base model."""
    source = resolve_base_model(info["base_model"], device="cpu", dtype="float32")
    skeleton = dataclasses.replace(source, weights="deferred").build().model
    peft_dir = staging / "peft"
    save_peft_adapter_tensors(
        load_file(str(adapters_file)),
        peft_dir,
        family=family_of_model(skeleton),
        lora=LoraConfig(**info["lora"]),
        base_model_name_or_path=info["base_model"],
        composite=skeleton.config.hf_composite,
    )
    for file in peft_dir.iterdir():
        file.rename(staging / file.name)
    peft_dir.rmdir()


def files_of(directory: Path) -> list[str]:
    """Every file of a checkpoint directory, relative to it, in POSIX form."""
    return sorted(
        file.relative_to(directory).as_posix() for file in directory.rglob("*") if file.is_file()
    )


class DownloadSigner:
    """Signs and checks download URLs under a key drawn at start (module doc)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def urls(
        self, path: CheckpointPath, files: list[str], *, base_url: str
    ) -> tuple[dict[str, str], int]:
        """A signed URL per file of `path` (an external weights checkpoint), and when they
        expire (seconds since the epoch)."""
        expires = int(time.time()) + URL_TTL_S
        urls = {}
        for file in files:
            where = f"{DOWNLOAD_PREFIX}/{path.run_id}/{path.name}/{quote(file)}"
            signature = self._signature(path, file, expires)
            urls[file] = f"{base_url.rstrip('/')}{where}?expires={expires}&signature={signature}"
        return urls, expires

    def check(self, path: CheckpointPath, file: str, *, expires: str, signature: str) -> bool:
        """Whether the URL's signature is this server's for this file and it has not expired."""
        if not expires.isdigit() or int(expires) < time.time():
            return False
        expected = self._signature(path, file, int(expires))
        return hmac.compare_digest(expected, signature)

    def _signature(self, path: CheckpointPath, file: str, expires: int) -> str:
        message = f"{path}\n{file}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
