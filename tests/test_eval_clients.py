"""Clients that load a release from its folder: transformers' pipeline and
lm-evaluation-harness, whose bits per byte must agree with our own held-out evaluation of the same text."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import pipeline

from spider_training.metrics import bits_per_byte
from tests.helpers import float_tol, model_terms, tiny_model
from tokenization_spider import BOS_ID, SpiderTokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = [
    "The state of the Union is strong.",
    "Fourscore and seven years ago our fathers brought forth, upon this continent, a new nation.",
    "Non-ASCII text counts in UTF-8 bytes: é and ü are two bytes each.",
]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release")
    model = tiny_model(seed=0).eval()
    model.save_pretrained(folder)
    SpiderTokenizer().save_pretrained(folder)
    return folder, model


def test_text_generation_pipeline_from_the_release_folder(release):
    folder, model = release
    generator = pipeline("text-generation", model=str(folder), trust_remote_code=True)
    text = generator("The state", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    tok = SpiderTokenizer()
    expected = model.generate(**tok("The state", return_tensors="pt"), max_new_tokens=6, do_sample=False)
    assert text == tok.decode(expected[0], skip_special_tokens=True)
    assert text.startswith("The state") and len(text.encode("utf-8", errors="replace")) > len("The state")


def _readme_recipe() -> tuple[str, str]:
    block = README.read_text().split("<!-- recipe:lm-eval -->", 1)[1]
    yaml = block.split("```yaml\n", 1)[1].split("```", 1)[0]
    bash = block.split("```bash\n", 1)[1].split("```", 1)[0]
    command = next(line for line in bash.replace("\\\n", " ").splitlines() if line.startswith("lm_eval "))
    return yaml, command


@pytest.mark.slow
def test_lm_eval_bits_per_byte_agrees_with_our_evaluation(release, tmp_path):
    """The README's lm-eval recipe, run as written (paths pointed at this test's release and text file)."""
    folder, model = release
    yaml, command = _readme_recipe()
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "my_text.yaml").write_text(yaml.replace("my_text.jsonl", str(tmp_path / "my_text.jsonl")))
    (tmp_path / "my_text.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    argv = shlex.split(command.replace("runs/spider-small/release", str(folder)))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", *argv[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next((tmp_path / "lm-eval-results").rglob("results_*.json")).read_text())
    theirs = result["results"]["my_text"]["bits_per_byte,none"]

    batches = []
    for doc in DOCS:
        ids = torch.tensor([[BOS_ID, *doc.encode("utf-8")]])
        batches.append({"input_ids": ids, "labels": ids})
    ours = bits_per_byte(model, batches)
    assert ours["bytes"] == sum(len(d.encode("utf-8")) for d in DOCS)
    # lm-eval batches the texts with padding (Spider's padding invariance) and sums log-probabilities in another
    # order: float32 roundoff of a whole-model forward, per byte
    torch.testing.assert_close(
        torch.tensor(theirs),
        torch.tensor(ours["bits_per_byte"]),
        **float_tol(torch.tensor(ours["bits_per_byte"]), model_terms(model)),
    )
