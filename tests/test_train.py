"""End-to-end tests of train_hf.py: smoke runs, resume equality, release loading, distributed launch."""

import dataclasses
import json
import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_hf
from spider_training import checkpointing
from spider_training.arguments import TK_TRAIN_FLAGS, parse_args
from tests.helpers import REMOTE_CODE_FILES, TINY_TRAIN_HF_ARGS, checkpoint_names, run_fresh_python

REPO = Path(__file__).resolve().parents[1]
TINY = TINY_TRAIN_HF_ARGS


def run(tmp_path, name, *extra):
    out = tmp_path / name
    summary = train_hf.main(TINY + ["--ckpt_dir", str(out), *extra])
    return out, summary


def losses(output_dir: Path, step: int) -> dict[int, float]:
    state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


def test_tk_train_flags_and_env_vars(monkeypatch):
    monkeypatch.setenv("SEQ_LEN", "48")
    monkeypatch.setenv("MICRO_BATCH", "3")
    monkeypatch.setenv("GRAD_ACCUM", "2")
    monkeypatch.setenv("LR", "2e-4")
    monkeypatch.setenv("CKPT_EVERY", "7")
    monkeypatch.setenv("TARGET_TOKENS", "10_000")
    args = parse_args(["--grad_accum", "1"])  # a flag wins over its env var
    assert (args.seq_len, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (48, 3, 1)
    assert args.learning_rate == 2e-4 and args.save_steps == 7
    assert args.max_steps == 10_000 // (3 * 1 * 48)
    args = parse_args(["--max_steps", "5"])  # TARGET_TOKENS capped by --max_steps
    assert args.max_steps == 5
    args = parse_args(["--mock_data", "--preset", "1b", "--no_gradient_checkpointing", "--compile", "--ckpt_dir", "x"])
    assert args.data == "mock" and args.activation_checkpointing is False and args.torch_compile
    assert args.output_dir == "x"
    monkeypatch.setenv("N_LOOPS", "many")
    with pytest.raises(ValueError, match="N_LOOPS"):
        parse_args([])


def test_every_tk_train_flag_lands_where_the_table_says(monkeypatch, tmp_path):
    """Each row of TK_TRAIN_FLAGS: the tk-train.py flag beats the TrainingArguments flag it stands for, which beats
    the table's default; --mock_data beats --data_dir."""
    for flag in TK_TRAIN_FLAGS.values():
        if flag.env:
            monkeypatch.delenv(flag.env, raising=False)
    args = parse_args(
        [
            "--micro_batch",
            "3",
            "--per_device_train_batch_size",
            "5",
            "--grad_accum",
            "4",
            "--gradient_accumulation_steps",
            "6",
            "--lr",
            "2e-4",
            "--learning_rate",
            "5e-4",
            "--ckpt_every",
            "9",
            "--save_steps",
            "11",
            "--ckpt_dir",
            "a",
            "--output_dir",
            "b",
            "--data_dir",
            str(tmp_path),
        ]
    )
    assert (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.learning_rate,
        args.save_steps,
        args.output_dir,
        args.data,
    ) == (3, 4, 2e-4, 9, "a", str(tmp_path))
    args = parse_args(
        [
            "--per_device_train_batch_size",
            "5",
            "--learning_rate",
            "5e-4",
            "--save_steps",
            "11",
            "--output_dir",
            "b",
            "--gradient_accumulation_steps",
            "6",
        ]
    )
    assert (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.learning_rate,
        args.save_steps,
        args.output_dir,
    ) == (5, 6, 5e-4, 11, "b")
    args = parse_args([])
    defaults = {flag.sets[0]: flag.default for flag in TK_TRAIN_FLAGS.values() if flag.sets and flag.default}
    assert (
        {name: getattr(args, name) for name in defaults}
        == defaults
        == {
            "per_device_train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3,
            "save_steps": 200,
            "output_dir": "runs/spider-small",
        }
    )
    assert args.seq_len == 256 and args.data == "sotu" and args.torch_compile is False
    assert parse_args(["--data_dir", str(tmp_path), "--mock_data"]).data == "mock"


def test_batches_are_copied_to_a_gpu_without_waiting_for_it(monkeypatch, tmp_path):
    """On CUDA the batches are pinned and copied with ``non_blocking`` (a blocking host-to-device copy is a host sync
    per tensor per micro-batch); a user's accelerator config file or ``--dataloader_pin_memory False`` wins, and off
    CUDA nothing is pinned. Test double: `_cuda_available` answers True for the arguments (TrainingArguments itself
    still sees this CPU machine)."""
    from spider_training import arguments

    args = parse_args([])
    assert not args.dataloader_pin_memory and not args.accelerator_config.non_blocking
    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    args = parse_args([])
    assert args.dataloader_pin_memory and args.accelerator_config.non_blocking
    args = parse_args(["--dataloader_pin_memory", "False"])
    assert not args.accelerator_config.non_blocking
    config = tmp_path / "accelerator.json"
    config.write_text('{"non_blocking": false, "split_batches": true}')
    args = parse_args(["--accelerator_config", str(config)])
    assert not args.accelerator_config.non_blocking and args.accelerator_config.split_batches


def test_compile_default_follows_the_measured_rule(monkeypatch):
    """Without --compile/--no_compile the run compiles on CUDA when its preset's compile was measured to pay within
    the run (`COMPILE_PAYS_AFTER_STEPS`: a 1b run of 640+ steps), and runs eagerly on CPU, for the small main job and
    for short runs; the flags override it, and contradict each other."""
    from spider_training import arguments
    from spider_training.compile import COMPILE_PAYS_AFTER_STEPS

    monkeypatch.delenv("TARGET_TOKENS", raising=False)
    pays = COMPILE_PAYS_AFTER_STEPS["1b"]
    long_1b = ["--preset", "1b", "--max_steps", str(pays)]
    assert parse_args(long_1b).torch_compile is False  # this machine: no CUDA
    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    assert parse_args(long_1b).torch_compile is True
    assert parse_args(["--preset", "1b", "--max_steps", str(pays - 1)]).torch_compile is False
    assert parse_args([]).torch_compile is False  # the small preset's 500-step main job
    assert parse_args([*long_1b, "--no_compile"]).torch_compile is False
    assert parse_args(["--compile"]).torch_compile is True
    assert parse_args(["--torch_compile"]).torch_compile is True  # TrainingArguments' own flag is kept
    with pytest.raises(ValueError, match="--compile and --no_compile"):
        parse_args(["--compile", "--no_compile"])


def test_fp8_on_cuda_compiles_and_is_not_run_eagerly_by_accident(monkeypatch):
    """On CUDA an FP8 run compiles by default, however short (torchao's float8 gains are stated under compile; eager
    FP8 measured up to 14x slower than bf16), asked for by `--precision fp8` or accelerate's
    `ACCELERATE_MIXED_PRECISION=fp8`; `--no_compile` with it is refused with a message naming the way out, unless
    `--allow_eager_fp8`. On CPU FP8 is emulated, a correctness path: eager, as every CPU run. Test double:
    `_cuda_available` answers True for the arguments (this machine has no GPU)."""
    from spider_training import arguments

    monkeypatch.delenv("TARGET_TOKENS", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert parse_args(["--precision", "fp8"]).torch_compile is False  # this machine: no CUDA
    assert parse_args(["--precision", "fp8", "--no_compile"]).torch_compile is False
    monkeypatch.setattr(arguments, "_cuda_available", lambda: True)
    assert parse_args([]).torch_compile is False  # the small main job in bf16: eager
    assert parse_args(["--precision", "fp8"]).torch_compile is True  # the same run in FP8: compiled
    with pytest.raises(ValueError, match="--allow_eager_fp8"):
        parse_args(["--precision", "fp8", "--no_compile"])
    assert parse_args(["--precision", "fp8", "--no_compile", "--allow_eager_fp8"]).torch_compile is False
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    assert parse_args([]).torch_compile is True
    with pytest.raises(ValueError, match="--precision fp8 with --no_compile"):
        parse_args(["--no_compile"])


def test_fp8_layer_options_are_checked(tmp_path):
    assert parse_args(["--fp8_layers", "tk_train"]).fp8_layers == "tk_train"
    for wrong in ("all", "seed"):  # "seed": tk-train.py's old name of tk_train, removed with fp8_moe.py
        with pytest.raises(ValueError, match=r"--fp8_layers must be one of \('auto', 'tk_train'\)"):
            parse_args(["--fp8_layers", wrong])
    with pytest.raises(ValueError, match="--fp8_gemm_table .*missing.json: no such file"):
        parse_args(["--fp8_gemm_table", str(tmp_path / "missing.json")])
    table = tmp_path / "table.json"
    table.write_text('{"gpus": {}}')
    assert parse_args(["--fp8_gemm_table", str(table)]).fp8_gemm_table == str(table)


def test_activation_checkpointing_default_follows_the_preset():
    """On for tk-train.py's 1B model (as tk-train.py trains it), off for the CPU presets; either flag overrides."""
    assert parse_args(["--preset", "1b"]).activation_checkpointing is True
    assert parse_args([]).activation_checkpointing is False
    assert parse_args(["--preset", "tiny"]).activation_checkpointing is False
    assert parse_args(["--activation_checkpointing", "true"]).activation_checkpointing is True
    assert parse_args(["--preset", "1b", "--no_gradient_checkpointing"]).activation_checkpointing is False


def test_bad_flags_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="--precision"):
        parse_args(["--precision", "fp4"])
    with pytest.raises(ValueError, match="--reset_steps needs --resume"):
        parse_args(["--reset_steps"])
    with pytest.raises(SystemExit):
        parse_args(["--seq_len", "abc"])
    with pytest.raises(ValueError, match="--extra_train_loops must be >= 0"):
        parse_args(["--extra_train_loops", "-1"])
    with pytest.raises(ValueError, match="--fp8_experts must be one of"):
        parse_args(["--fp8_experts", "always"])


def test_trainer_reads_its_settings_from_spider_training_arguments(tmp_path):
    """One settings object: a SpiderTrainingArguments built in Python is checked as the command line is (each error
    naming the flag); a plain TrainingArguments given to SpiderTrainer becomes one with every field it had and
    Spider's at their defaults (as TRL's trainers convert theirs), and the trainer reads its settings from it."""
    from transformers import TrainingArguments, default_data_collator

    from spider_training.arguments import SpiderTrainingArguments, spider_training_arguments
    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer
    from tests.helpers import tiny_model

    with pytest.raises(ValueError, match="--precision must be one of"):
        SpiderTrainingArguments(output_dir=str(tmp_path), precision="fp4")
    with pytest.raises(ValueError, match="--eval_windows must be >= 1, got 0"):
        SpiderTrainingArguments(output_dir=str(tmp_path), eval_windows=0)
    plain = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=3, learning_rate=2e-4
    )
    converted = spider_training_arguments(plain)
    assert isinstance(converted, SpiderTrainingArguments)
    assert (converted.per_device_train_batch_size, converted.learning_rate, converted.output_dir) == (
        3,
        2e-4,
        str(tmp_path),
    )
    defaults = SpiderTrainingArguments(output_dir=str(tmp_path))
    assert (converted.eval_windows, converted.sdpa_backend, converted.muon_lr) == (
        defaults.eval_windows,
        defaults.sdpa_backend,
        defaults.muon_lr,
    )
    trainer = SpiderTrainer(
        model=tiny_model(seed=0),
        args=plain,
        train_dataset=build_dataset("mock", 32),
        data_collator=default_data_collator,
        stop_signals=(),
    )
    assert isinstance(trainer.args, SpiderTrainingArguments) and trainer.args.per_device_train_batch_size == 3
    assert trainer.precision == "fp32" and trainer.n_loops is None  # CPU: precision auto is fp32; n_loops the config's


@pytest.mark.slow
def test_config_overrides_use_the_transformers_format(tmp_path):
    """`--config_overrides` goes through SpiderConfig.update_from_string (transformers' key=value,... format): scalars
    by the field's type, lists and null as JSON, derived fields follow; with --init_from the overrides apply to the
    loaded config and the weights are the saved ones."""
    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.train import build_model

    args = parse_args(
        TINY
        + [
            "--ckpt_dir",
            str(tmp_path / "run"),
            "--config_overrides",
            "n_loops=3,engram_layer_ids=[0,1],sliding_window=null,norm_topk_prob=false,"
            "boundary_prior=0.25,num_recurrent_layers=3",
        ]
    )
    config = build_model(args).config
    assert (config.n_loops, config.engram_layer_ids, config.sliding_window) == (3, [0, 1], None)
    assert (config.norm_topk_prob, config.boundary_prior, config.num_recurrent_layers) == (False, 0.25, 3)
    assert config.num_hidden_layers == config.num_prelude_layers + 3 + config.num_coda_layers

    torch.manual_seed(0)
    saved = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny"))
    saved.save_pretrained(tmp_path / "init")
    args = parse_args(
        TINY
        + [
            "--ckpt_dir",
            str(tmp_path / "run2"),
            "--init_from",
            str(tmp_path / "init"),
            "--config_overrides",
            "n_loops=3,sliding_window=8",
        ]
    )
    loaded = build_model(args)
    assert (loaded.config.n_loops, loaded.config.sliding_window) == (3, 8)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)

    bad = SpiderConfig.from_preset("tiny")
    with pytest.raises(ValueError, match=r"SpiderConfig\.n_loops=0 is invalid"):
        bad.update_from_string("n_loops=0")


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """One finished 6-step fp32 run (a checkpoint every 2 steps, the newest two kept, and the release), shared by the
    tests that read one: the smoke test, resume, --reset_steps and the release in a fresh process (each copies what
    it changes). Returns the output folder, the summary, and the n_loops of every held-out scoring pass (Trainer's
    evaluation loop)."""
    from spider_training.trainer import SpiderTrainer

    scored = []
    original = SpiderTrainer.evaluation_loop
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(
            SpiderTrainer,
            "evaluation_loop",
            lambda self, *args, **kwargs: scored.append(self.n_loops) or original(self, *args, **kwargs),
        )
        out, summary = run(
            tmp_path_factory.mktemp("fp32_run"), "fp32", "--max_steps", "6", "--save_steps", "2", "--precision", "fp32"
        )
    return out, summary, scored


def test_smoke_fp32_writes_complete_checkpoints_and_release(fp32_run):
    out, summary, scored = fp32_run
    # before training, at each of the 6 steps, then loops 1 and 4 only (the final step's score is reused for
    # eval_after and the trained loop count, not computed again), and once with ACT early exit (the configured count)
    assert sorted(map(str, scored)) == sorted(["None"] * 8 + ["1", "4"]), scored
    assert summary["steps"] == 6 and summary["precision"] == "fp32"
    assert summary["eval_after_bits_per_byte"] < summary["eval_before_bits_per_byte"]
    # newest two checkpoints kept (Trainer's rotation), no staging debris, plus the release
    assert checkpoint_names(out) == ["checkpoint-4", "checkpoint-6"]
    assert not (out / checkpointing.STAGING_DIRNAME).exists()
    ckpt = out / "checkpoint-6"
    for name in (
        "model.safetensors",
        "config.json",
        *REMOTE_CODE_FILES,
        "tokenizer_config.json",
        "optimizer.pt",
        "trainer_state.json",
    ):
        assert (ckpt / name).exists(), name
    release = out / "release"
    for name in ("model.safetensors", "config.json", *REMOTE_CODE_FILES, "README.md", "loss_curve.png"):
        assert (release / name).exists(), name
    # the card is titled with the model, not the folder; it shows the held-out curve its caption promises (the
    # Trainer evaluated during training), the loops sweep, and names no file the release does not hold
    card = (release / "README.md").read_text()
    params = summary["parameters"] / 1e6
    assert f"# spider-tiny-{params:.1f}M" in card and f"- name: spider-tiny-{params:.1f}M" in card
    assert "# release" not in card and "SPEC.md" not in card
    assert "| 2 (trained) |" in card and set(summary["bits_per_byte_by_loops"]) == {"1", "2", "4"}
    exit_result = summary["act_early_exit"]  # measured with ACT early exit, then switched back off
    assert 0 <= exit_result["loops_saved_per_segment"] <= 1 and math.isfinite(exit_result["bits_per_byte"])
    assert f"saves {exit_result['loops_saved_per_segment']:.3f} loops" in card
    assert json.loads((release / "config.json").read_text())["act_early_exit"] is False
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "eval_loss" in e] == [1, 2, 3, 4, 5, 6]  # max_steps // 10 -> 1
    logged = [e for e in state["log_history"] if "loss" in e][-1]
    for key in (
        "lm_loss",
        "aux_loss",
        "boundary_loss",
        "ponder_loss",
        "bits_per_byte",
        "compression_rate",
        "expert_load_max",
        "mean_halting_step",
        "tokens_per_second",
        "peak_memory_mb",
    ):
        assert key in logged and logged[key] == logged[key], key  # present and not NaN


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_smoke_bf16_and_emulated_fp8(tmp_path, precision):
    # --fp8_layers tk_train: the default (auto) leaves every layer of the tiny preset in bf16, too small for FP8 to pay
    extra = ["--fp8_layers", "tk_train"] if precision == "fp8" else []
    out, summary = run(
        tmp_path,
        precision,
        "--max_steps",
        "3",
        "--save_steps",
        "3",
        "--precision",
        precision,
        "--sample_bytes",
        "0",
        *extra,
    )
    assert summary["precision"] == precision
    assert "sample" not in summary  # --sample_bytes 0 skips the sample
    assert summary["train_loss"] == summary["train_loss"]
    from modeling_spider import SpiderForConditionalGeneration

    plain = SpiderForConditionalGeneration.from_pretrained(out / "checkpoint-3")  # loads into a plain model
    assert not any("Float8" in type(m).__name__ for m in plain.modules())


@pytest.mark.slow
def test_resume_continues_the_same_trajectory(tmp_path, fp32_run):
    straight, _, _ = fp32_run
    expected = losses(straight, 6)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(straight / "checkpoint-4", resumed_dir / "checkpoint-4")
    # auto-resume: picks the newest complete checkpoint of ckpt_dir, ignoring staging debris
    (resumed_dir / checkpointing.STAGING_DIRNAME / "checkpoint-9").mkdir(parents=True)
    train_hf.main(
        TINY + ["--ckpt_dir", str(resumed_dir), "--max_steps", "6", "--save_steps", "2", "--precision", "fp32"]
    )
    got = losses(resumed_dir, 6)
    for step in (5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5), step


@pytest.mark.slow
def test_reset_steps_loads_weights_only(tmp_path, fp32_run):
    first, _, _ = fp32_run
    second, summary = run(
        tmp_path,
        "second",
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--resume",
        str(first / "checkpoint-6"),
        "--reset_steps",
    )
    assert summary["steps"] == 2  # restarted at step 0 (resuming the step-6 checkpoint would have stopped at 6)


@pytest.mark.slow
def test_release_loads_in_fresh_process(tmp_path, fp32_run):
    """The release loads and generates in a fresh process with the Auto classes, and the model card's Usage snippet,
    exactly as a reader copies it (it names this folder: no hub id was given), runs there first, on its own."""
    out, _, _ = fp32_run
    card = (out / "release" / "README.md").read_text()
    usage = card.split("## Usage", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert f'repo = "{out / "release"}"' in usage
    # after the snippet, in the same interpreter (one start instead of two): the Auto classes by hand
    code = usage + (
        "\nimport sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "ids = t('Hello', return_tensors='pt')\n"
        "print('generated length', m.generate(**ids, max_new_tokens=3, do_sample=False).shape[1])\n"
    )
    stdout = run_fresh_python(code, str(out / "release"), workdir=tmp_path)
    assert stdout.startswith("The state of the Union is")
    assert stdout.strip().splitlines()[-1] == "generated length 10"  # BOS + 5 bytes + EOS + 3 new


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_ddp_run(tmp_path):
    """The README's CPU DDP command with the shipped configs/accelerate/ddp_cpu.yaml (accelerate starts the two
    processes with torchrun, the README's other command)."""
    out = tmp_path / "ddp"
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs/accelerate/ddp_cpu.yaml"),
        "--main_process_port",
        str(_free_port()),
    ]
    cmd = [
        *launch,
        str(REPO / "train_hf.py"),
        *TINY,
        "--ckpt_dir",
        str(out),
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--use_cpu",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert '"world_size": 2' in result.stdout and '"distributed_type": "DistributedType.MULTI_CPU"' in result.stdout


def test_launcher_mismatch_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """``accelerate launch --multi_gpu --num_processes 2`` on CPU without ``--use_cpu`` starts two processes
    (``WORLD_SIZE=2``) that accelerate counts as one each: train_hf.py's entry point refuses, naming the fix, before
    the run lock, the model and the data (nothing in ``--ckpt_dir``)."""
    from spider_training.trainer import LaunchMismatchError

    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "mismatch"
    with pytest.raises(LaunchMismatchError, match="--use_cpu"):
        run(tmp_path, "mismatch", "--max_steps", "1")
    assert not out.exists() or not any(out.iterdir())


def test_check_launch_refuses_only_a_lone_process_of_a_multi_process_launch(monkeypatch):
    """What train_hf.py checks before building anything (and SpiderTrainer again): several launched processes that
    accelerate counts as one are refused, naming the fix; a matching count, or a single launch, passes."""
    from spider_training.trainer import LaunchMismatchError, check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchMismatchError, match="WORLD_SIZE=2 .* --use_cpu"):
        check_launch(1)
    check_launch(2)
    monkeypatch.delenv("WORLD_SIZE")
    check_launch(1)


def test_accelerate_fp8_config_converts_once(tmp_path, monkeypatch):
    """FP8 asked through accelerate's own config: SpiderTrainer converts once (its --fp8_layers filter); accelerate
    does not."""
    from transformers import default_data_collator

    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    torch.manual_seed(0)
    model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny"))
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=2,
        remove_unused_columns=False,
        save_strategy="no",
        precision="fp32",
        fp8_layers="tk_train",
    )
    trainer = SpiderTrainer(
        model=model,
        args=args,
        train_dataset=build_dataset("mock", 32),
        data_collator=default_data_collator,
    )
    assert trainer.precision == "fp8" and trainer.fp8_report.converted
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    float8 = [name for name, m in trainer.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert set(float8) == set(trainer.fp8_report.converted)


def test_training_draws_the_loop_count_per_step_and_evaluation_runs_n_loops(tmp_path):
    """extra_train_loops=1: each training step runs n_loops or n_loops + 1, the same count for both micro-batches of
    a step, drawn from (seed, step) alone (so a resumed run draws what the uninterrupted one did); evaluation runs
    the configured n_loops."""
    from transformers import default_data_collator

    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer, training_loop_count

    torch.manual_seed(0)
    model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny", n_loops=2))
    seen = []  # (training mode, the n_loops passed) per forward
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((m.training, kwargs.get("n_loops"))), with_kwargs=True
    )
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=8,
        seed=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        remove_unused_columns=False,
        save_strategy="no",
        eval_strategy="no",
        extra_train_loops=1,
        eval_windows=2,
    )
    data = build_dataset("mock", 32)
    trainer = SpiderTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        data_collator=default_data_collator,
    )
    trainer.train()
    counts = [n for training, n in seen if training]
    assert len(counts) == 16
    per_step = counts[::2]
    assert counts[1::2] == per_step
    assert per_step == [training_loop_count(2, 1, 3, step) for step in range(8)]
    assert set(per_step) == {2, 3}
    seen.clear()
    trainer.evaluate()
    assert seen and all(not training and n is None for training, n in seen)  # the config's n_loops
    with pytest.raises(ValueError, match="extra_train_loops must be >= 0"):
        SpiderTrainer(
            model=model,
            args=dataclasses.replace(args, extra_train_loops=-1),
            train_dataset=data,
            data_collator=default_data_collator,
        )


def test_evaluation_runs_trainer_loop_and_counts_bits_per_byte_in_bytes(tmp_path):
    """evaluate() is Trainer's own (speed metrics, on_evaluate, the log) over the first eval_windows windows rounded
    up to whole batches, and its bits per byte is the held-out NLL summed over predicted bytes divided by their
    count: a window that is mostly padding weighs by its few bytes, not as one window or one batch. The same
    figure as spider_training.metrics.bits_per_byte over the same windows."""
    from torch.utils.data import DataLoader, Subset
    from transformers import default_data_collator

    from configuration_spider import SpiderConfig
    from modeling_spider import SpiderForConditionalGeneration
    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.data import FirstWindows, build_dataset
    from spider_training.metrics import bits_per_byte
    from spider_training.trainer import SpiderTrainer

    torch.manual_seed(0)
    model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny", n_loops=2))
    windows = [build_dataset("mock", 32)[k] for k in range(6)]
    padded = {name: value.clone() for name, value in windows[1].items()}
    padded["labels"][4:] = -100  # 3 predicted bytes in this window, 32 in the others
    windows[1] = padded
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_eval_batch_size=2,
        remove_unused_columns=False,
        eval_windows=3,
    )
    trainer = SpiderTrainer(model=model, args=args, eval_dataset=windows, data_collator=default_data_collator)
    metrics = trainer.evaluate()
    assert metrics["eval_bytes"] == 3 * 32 + 3  # windows 0-3: eval_windows=3 rounded up to two batches of 2
    assert {"eval_runtime", "eval_samples_per_second"} <= set(metrics)  # Trainer's evaluate, not a replacement
    assert trainer.state.log_history[-1]["eval_bits_per_byte"] == metrics["eval_bits_per_byte"]
    assert (
        metrics["eval_loss"] == metrics["eval_lm_loss"] == pytest.approx(metrics["eval_bits_per_byte"] * math.log(2))
    )
    reference = bits_per_byte(model, DataLoader(Subset(windows, range(4)), batch_size=2))
    # both sum float64 per-byte NLLs, in another order: within a few float64 roundings of the sum
    assert metrics["eval_bits_per_byte"] == pytest.approx(reference["bits_per_byte"], rel=64 * 2.0**-52)
    assert metrics["eval_bytes"] == reference["bytes"]
    # the padded window counts by its 3 bytes: the byte-weighted mean differs from the mean of window means
    per_window = [bits_per_byte(model, [{k: v[None] for k, v in w.items()}])["bits_per_byte"] for w in windows[:4]]
    assert abs(sum(per_window) / 4 - metrics["eval_bits_per_byte"]) > 1e-6
    # the loop sweep goes through the same loop at another count, and leaves the trainer's count alone
    assert trainer.evaluate_loop_counts([1, 2])["2"] == metrics["eval_bits_per_byte"]
    assert trainer.n_loops is None
    assert [w["input_ids"].tolist() for w in FirstWindows(iter_windows(windows), 2)] == [
        w["input_ids"].tolist() for w in windows[:2]
    ]
    with pytest.raises(ValueError, match="count must be >= 1"):
        FirstWindows(iter_windows(windows), 0)


def test_evaluation_scores_another_causal_lm_in_bits_per_byte(tmp_path):
    """A dense byte model (experiments.quality's peer) evaluates through the same loop: bits per byte from its logits,
    no segment or halting figures (it has neither), equal to the summed next-byte cross-entropy of its own logits."""
    from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator

    from spider_training.arguments import SpiderTrainingArguments
    from spider_training.data import build_dataset
    from spider_training.trainer import SpiderTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=272,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    windows = [build_dataset("mock", 32)[k] for k in range(4)]
    args = SpiderTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_eval_batch_size=2,
        remove_unused_columns=False,
        eval_windows=4,
    )
    metrics = SpiderTrainer(
        model=model, args=args, eval_dataset=windows, data_collator=default_data_collator
    ).evaluate()
    assert "eval_compression_rate" not in metrics and "eval_mean_halting_step" not in metrics
    nll = [
        torch.nn.functional.cross_entropy(
            model(input_ids=w["input_ids"][None]).logits[0, :-1], w["labels"][1:], reduction="sum"
        ).item()
        for w in windows
    ]
    assert metrics["eval_bytes"] == 4 * 32
    assert metrics["eval_bits_per_byte"] == pytest.approx(sum(nll) / (4 * 32) / math.log(2), rel=1e-5)


def iter_windows(windows):
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(windows)

    return Stream()


@pytest.mark.slow
def test_push_to_hub_against_fake_hub_and_closed_port(tmp_path, monkeypatch):
    """Checkpoints and the release reach a local fake Hub (test double); a dead endpoint only warns."""
    from huggingface_hub import constants

    from tests.hub_server import FakeHubServer

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the fake Hub speaks the plain LFS protocol only
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with FakeHubServer(token="hf_fake") as server:
        out, summary = run(
            tmp_path,
            "pushed",
            "--max_steps",
            "2",
            "--save_steps",
            "1",
            "--push_to_hub",
            "--hub_model_id",
            "spider/tiny",
            "--hub_token",
            "hf_fake",
            "--hub_endpoint",
            server.url,
        )
        files = server.files("spider/tiny")
    assert summary["pushed"] is True
    release = out / "release"
    for name in ("model.safetensors", "config.json", "modeling_spider.py", "README.md", "loss_curve.png"):
        assert files[name] == (release / name).read_bytes(), name
    assert any(path.startswith("last-checkpoint/") and path.endswith("model.safetensors") for path in files)

    out, summary = run(
        tmp_path,
        "dead",
        "--max_steps",
        "2",
        "--save_steps",
        "1",
        "--push_to_hub",
        "--hub_model_id",
        "spider/tiny",
        "--hub_token",
        "hf_fake",
        "--hub_endpoint",
        f"http://127.0.0.1:{_free_port()}",
    )
    assert summary["pushed"] is False and summary["steps"] == 2
    assert (out / "release" / "model.safetensors").exists()


def test_resume_with_another_data_layout_is_refused(tmp_path):
    """Issue 67 D3: a checkpoint records its run's processes, micro-batch and accumulation; resuming with another
    layout (here: one process resuming a two-process checkpoint, or another micro-batch) would skip and repeat windows,
    so it is refused with a message naming both layouts; the same layout resumes."""
    from spider_training.checkpointing import DATA_LAYOUT_NAME
    from tests.helpers import cpu_trainer

    def trainer(batch: int, steps: int):
        return cpu_trainer(
            tmp_path, max_steps=steps, per_device_train_batch_size=batch, save_strategy="steps", save_steps=1
        )

    trainer(2, 1).train()
    checkpoint = tmp_path / "checkpoint-1"
    layout = json.loads((checkpoint / DATA_LAYOUT_NAME).read_text())
    assert layout == {"world_size": 1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    with pytest.raises(
        ValueError,
        match=r"written by a run of 1 process\(es\) x 2 windows x 1 accumulation step\(s\); "
        r"this run has 1 process\(es\) x 4 windows",
    ):
        trainer(4, 2).train(resume_from_checkpoint=str(checkpoint))
    (checkpoint / DATA_LAYOUT_NAME).write_text(json.dumps({**layout, "world_size": 2}))
    with pytest.raises(ValueError, match=r"2 process\(es\) x 2 windows .* --init_from"):
        trainer(2, 2).train(resume_from_checkpoint=str(checkpoint))
    (checkpoint / DATA_LAYOUT_NAME).write_text(json.dumps(layout))
    resumed = trainer(2, 2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2


def test_text_sample_by_splits_local_txt_files(tmp_path):
    """``--text_sample_by line`` reaches the dataset: a 3-line .txt is 3 documents (1 by default); a wrong value names
    the flag."""
    from spider_training.train import build_trainer
    from tests.helpers import tiny_model

    text = tmp_path / "corpus.txt"
    text.write_text("first line\nsecond line\nthird line\n")
    documents = {}
    for mode in ("document", "line"):
        args = parse_args(
            [
                "--data",
                str(text),
                "--text_sample_by",
                mode,
                "--seq_len",
                "16",
                "--max_steps",
                "1",
                "--ckpt_dir",
                str(tmp_path / mode),
                "--use_cpu",
            ]
        )
        trainer = build_trainer(args, tiny_model(), stop_signals=())
        documents[mode] = trainer.train_dataset.stats.documents
    assert documents == {"document": 1, "line": 3}
    with pytest.raises(ValueError, match="--text_sample_by must be document, paragraph or line; got 'word'"):
        parse_args(["--text_sample_by", "word"])
