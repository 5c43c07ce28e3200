"""Small builders shared by the test modules."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from configuration_spider import SpiderConfig
from modeling_spider import SpiderForConditionalGeneration

#: the repository root (the commands below run from it)
REPO = Path(__file__).resolve().parents[1]

#: the module files a release ships and ``trust_remote_code`` loads (setup.cfg's ``py_modules``)
REMOTE_CODE_FILES = (
    "configuration_spider.py",
    "modeling_spider.py",
    "generation_spider.py",
    "conversion_spider.py",
    "tokenization_spider.py",
)
#: ``train_hf.py``'s arguments of a tiny CPU run (tiny preset, 2 x 32 bytes, a log line every step, 4 held-out
#: windows, a 4-byte sample, no dataloader workers) on its default data; the tests add ``--data mock`` and the rest
TINY_TRAIN_HF_ARGS = [
    *("--preset", "tiny", "--seq_len", "32", "--micro_batch", "2", "--eval_windows", "4", "--sample_bytes", "4"),
    *("--logging_steps", "1", "--dataloader_num_workers", "0"),
]


def tiny(**overrides) -> SpiderConfig:
    """The `tiny` preset with overrides."""
    return SpiderConfig.from_preset("tiny", **overrides)


def tiny_model(seed: int = 0, **overrides) -> SpiderForConditionalGeneration:
    """A freshly initialised tiny model, reproducible for a given `seed`."""
    torch.manual_seed(seed)
    return SpiderForConditionalGeneration(tiny(**overrides))


def save_tiny_release(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save :func:`tiny_model` (`seed`, config `overrides`) and the tokenizer to `folder` as a release is saved
    (weights, config, the remote-code files, the tokenizer files); returns `folder`."""
    from tokenization_spider import SpiderTokenizer

    tiny_model(seed, **overrides).save_pretrained(folder)
    SpiderTokenizer().save_pretrained(folder)
    return folder


def random_bytes(batch: int, length: int, seed: int = 0) -> torch.LongTensor:
    """int64 ``(batch, length)`` ids drawn uniformly from the 256 byte values (no specials), seeded."""
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def train_step(model, input_ids: torch.Tensor, seed: int = 1):
    """One training forward+backward with a fixed seed (the boundary predictor samples).

    Returns `(outputs, grads)`: the model output and `{name: gradient copy}` of every parameter that got one."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def write_headerless_shard(path: Path, tokens) -> Path:
    """A headerless little-endian ``uint16`` byte shard (tk-train.py's format) holding `tokens`; returns `path`."""
    np.asarray(tokens, dtype="<u2").tofile(path)
    return path


def write_header_shard(path: Path, tokens, *, magic=20240520, version=1, count=None) -> Path:
    """A modded-nanogpt / parameter-golf shard: 256 int32 header (`magic`, `version`, token `count`, default
    `len(tokens)`), then `tokens` as ``uint16``; returns `path`."""
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())
    return path


def float_tol(reference: torch.Tensor, terms: int, ulps: float = 8.0) -> dict:
    """``assert_close`` tolerances for two computations of `reference` that differ only in the order of floating-point
    operations (another kernel, summation order, thread count or CPU), derived instead of tuned on one machine.

    Recursive summation of `terms` values carries an error of at most ``(terms - 1) * eps * sum|x_i|`` (Higham 2002,
    "Accuracy and Stability of Numerical Algorithms", §4.2); bounding ``sum|x_i|`` by the magnitude of the result and
    allowing `ulps` units of roundoff per term gives ``rtol = ulps * eps * terms`` and ``atol = rtol *
    max|reference|``,
    with eps the machine epsilon of `reference`'s dtype. `terms` is the longest chain of accumulations that feeds an
    element: the reduction length of a matmul (its inner dimension), times the number of such layers in sequence for a
    whole-model output. Returns ``dict(rtol=..., atol=...)``."""
    eps = torch.finfo(reference.dtype).eps
    bound = ulps * eps * max(1, terms)
    scale = float(reference.detach().abs().max()) if reference.numel() else 1.0
    return dict(rtol=bound, atol=bound * max(scale, 1e-30))


def model_terms(model) -> int:
    """The `terms` of :func:`float_tol` for a whole-model output of `model`: its hidden size times the number of
    layers a byte passes through (prelude, every recurrent layer in every loop, coda)."""
    c = model.config
    return c.hidden_size * (c.num_prelude_layers + c.num_recurrent_layers * c.n_loops + c.num_coda_layers + 1)


def run_readme_recipe(marker: str, release: Path, workdir: Path) -> None:
    """Run the README's Python block after ``<!-- recipe:MARKER -->`` as written, except that its
    ``release = "runs/spider-small/release"`` line names `release`, in a fresh process (cwd `workdir`, its own
    remote-code module cache, no PYTHONPATH) that loads the release through trust_remote_code. Fails with the
    process's stderr."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split(f"<!-- recipe:{marker} -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    line = 'release = "runs/spider-small/release"'
    assert line in block, f"the {marker} recipe no longer names the release folder as {line}"
    run_fresh_python(block.replace(line, f"release = {str(release)!r}"), workdir=workdir)


def run_fresh_python(code: str, *argv: str, workdir: Path, timeout: int = 600) -> str:
    """Run `code` (``python -c``) with `argv` in a fresh process, as a user's script would: cwd `workdir`, no
    PYTHONPATH (so trust_remote_code loads a release's own files, not this checkout's), a remote-code module cache
    of its own; it exits without collecting the libraries' objects first (``gc.freeze`` after `code`, as
    ``train_hf.py`` does: about 1.5 s a process). Fails with the process's stderr; returns its stdout."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(workdir / "modules")
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport gc; gc.freeze()\n", *argv],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def assert_lora_adapters_trained(adapter_file: Path) -> None:
    """Every LoRA B matrix in a saved PEFT adapter is non-zero (peft starts B at zero), the router's included."""
    from safetensors.torch import load_file

    lora_b = {k: v for k, v in load_file(adapter_file).items() if "lora_B" in k}
    assert any(k.endswith("mlp.router.lora_B.weight") for k in lora_b)  # the router got an adapter too
    assert all(v.abs().sum() > 0 for v in lora_b.values())


def checkpoint_names(output_dir) -> list[str]:
    """The published ``checkpoint-N`` folders of `output_dir` that hold a trainer state, oldest step first (what the
    fault-tolerance tests assert survived)."""
    import re

    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), child.name)
        for child in folder.iterdir()
        if (m := re.fullmatch(r"checkpoint-(\d+)", child.name)) and (child / "trainer_state.json").is_file()
    ]
    return [name for _, name in sorted(found)]


def per_expert_state_dict(state: dict) -> dict:
    """`state` (a Spider state dict) in the routed experts' per-expert layout of older releases, which is also
    tk-train.py's: each
    fused ``P.experts.gate_up_proj`` `(E, 2I, D)` / ``P.experts.down_proj`` `(E, D, I)` pair split into
    ``P.experts.{e}.gate_proj.weight``, ``up_proj.weight`` `(I, D)` and ``down_proj.weight`` `(D, I)`, at the position
    the ModuleList of experts held (after the router, before the shared experts). Written by hand, independently of
    the model's load-time conversion."""
    out = {}
    for key, value in state.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            intermediate = value.shape[1] // 2
            down = state[prefix + "down_proj"]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :intermediate].clone()
                out[f"{prefix}{e}.up_proj.weight"] = value[e, intermediate:].clone()
                out[f"{prefix}{e}.down_proj.weight"] = down[e].clone()
        elif not key.endswith(".mlp.experts.down_proj"):
            out[key] = value.clone()
    return out


def cpu_trainer(output_dir, model=None, train_dataset=None, trainer_kwargs: dict | None = None, **training_args):
    """A ``SpiderTrainer`` on this CPU for a test: `model` (default :func:`tiny_model`) on `train_dataset` (default
    32-byte ``mock`` windows), one step of 2 windows, no evaluation, saving, reporting or signal handlers unless
    `training_args` (``SpiderTrainingArguments`` fields, Spider's settings included) say otherwise; `trainer_kwargs`
    go to ``SpiderTrainer``."""
    from transformers import default_data_collator

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer

    defaults = dict(
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=2,
        eval_strategy="no",
        save_strategy="no",
        remove_unused_columns=False,
    )
    args = SpiderTrainingArguments(output_dir=str(output_dir), **{**defaults, **training_args})
    return SpiderTrainer(
        model=tiny_model() if model is None else model,
        args=args,
        train_dataset=build_dataset("mock", 32) if train_dataset is None else train_dataset,
        data_collator=default_data_collator,
        **{"stop_signals": (), **(trainer_kwargs or {})},
    )


def run_module(module: str, *args, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root with this checkout first on ``PYTHONPATH``, output captured
    as text: how tests drive a command (``bench``'s runners among them) through its command line and JSON files
    rather than its internals. Raises ``subprocess.TimeoutExpired`` after `timeout` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
