"""Default sampling parameters from the model's generation_config.json, as vLLM applies them (the
server's `--generation-config auto`, its default, and LLM(generation_config="auto") when generate is given
no sampling_params): a request's own values win, the file fills what it leaves out,
SamplingParams' defaults the rest. `vllm` ignores the file; a folder path reads the file from there."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from deltaserve.sampling import SamplingParams
from deltaserve.tokenizer import read_json_object

log = logging.getLogger(__name__)

# generation_config.json name -> SamplingParams name (vLLM's list)
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: Path, mode: str = "auto") -> dict[str, Any]:
    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else Path(mode)
    path = folder / "generation_config.json"
    data = read_json_object(path)
    if data is None:
        if mode != "auto":
            raise ValueError(f"--generation-config {mode}: there is no generation_config.json in {folder}")
        return {}
    defaults = {ours: data[theirs] for theirs, ours in _FIELDS.items() if data.get(theirs) is not None}
    try:
        SamplingParams(**defaults)  # a bad value fails here, at start, not in every request
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e} (pass --generation-config vllm to ignore the file)") from e
    if defaults:
        log.info("default sampling parameters from %s (a request's own values win): %s", path, defaults)
    return defaults
