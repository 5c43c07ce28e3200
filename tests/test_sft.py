"""SpiderSFTTrainer: TRL's SFTTrainer trains a Spider release with all of Spider's loss terms."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import SFTConfig  # noqa: E402

from configuration_spider import SpiderConfig  # noqa: E402
from modeling_spider import SpiderForConditionalGeneration  # noqa: E402
from spider_training.sft import SpiderSFTTrainer  # noqa: E402
from tests.helpers import assert_lora_adapters_trained, float_tol, run_readme_recipe  # noqa: E402
from tokenization_spider import SpiderTokenizer  # noqa: E402

TEXTS = [
    "Four score and seven years ago our fathers brought forth on this continent a new nation.",
    "We hold these truths to be self-evident.",
] * 8


def _release(tmp_path, **overrides):
    torch.manual_seed(0)
    config = SpiderConfig.from_preset("tiny", router_aux_loss_coef=0.01, ponder_loss_coef=0.01, **overrides)
    SpiderForConditionalGeneration(config).save_pretrained(tmp_path / "release")
    SpiderTokenizer().save_pretrained(tmp_path / "release")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "release", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "release", trust_remote_code=True)
    return model, tokenizer


def _trainer(tmp_path, model, tokenizer, **config):
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        max_length=64,
        save_strategy="no",
        **config,
    )
    return SpiderSFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer
    )


def test_sft_loss_is_spiders_own_loss_with_the_same_gradients(tmp_path):
    model, tokenizer = _release(tmp_path)
    trainer = _trainer(tmp_path, model, tokenizer, max_steps=1)
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["labels"] == -100).any()  # padded rows: the ignored labels take part
    model.train()  # deterministic all the same: hard boundaries, no dropout in the tiny preset
    watched = [
        model.model.recurrent_block.halt_predictor.weight,
        model.model.flexitokens.boundary_predictor.out_proj.weight,
        model.model.recurrent_block.layers[0].mlp.router.weight,
    ]

    own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    own_grads = torch.autograd.grad(own.loss, watched)
    # the comparison is not vacuous: Spider's extra terms move the loss
    assert float((own.loss - own.lm_loss).detach()) > 1e-3
    loss = trainer.compute_loss(model, dict(batch))
    grads = torch.autograd.grad(loss, watched)

    torch.testing.assert_close(loss, own.loss, **float_tol(own.loss, terms=batch["input_ids"].numel()))
    for grad, own_grad in zip(grads, own_grads):
        torch.testing.assert_close(grad, own_grad, **float_tol(own_grad, terms=batch["input_ids"].numel()))


def test_sft_trains_logs_each_term_and_saves_the_release_config(tmp_path):
    model, tokenizer = _release(tmp_path)
    trainer = _trainer(tmp_path, model, tokenizer, max_steps=2)
    assert model.config.router_aux_loss_coef == 0.01  # TRL set 0.0 to keep its Mixtral loss off; put back
    before = model.model.flexitokens.boundary_predictor.out_proj.weight.detach().clone()
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert {"aux_loss", "boundary_loss", "ponder_loss"} <= set(entry)
    assert not torch.equal(before, model.model.flexitokens.boundary_predictor.out_proj.weight)
    trainer.save_model(str(tmp_path / "tuned"))
    saved = SpiderConfig.from_pretrained(tmp_path / "tuned")
    assert saved.router_aux_loss_coef == 0.01 and saved.ponder_loss_coef == 0.01


def test_plain_sft_trainer_is_what_this_class_fixes(tmp_path):
    """The control: TRL's own SFTTrainer takes Spider for Mixtral (its balancing loss fails on per-segment router
    logits). If a TRL release stops doing this, this test says so."""
    from trl import SFTTrainer

    model, tokenizer = _release(tmp_path)
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
        report_to=[],
        max_length=64,
        save_strategy="no",
        max_steps=1,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer
    )
    with pytest.raises(RuntimeError, match="size of tensor"):
        trainer.train()


def test_trl_router_coefficient_and_paths_are_refused(tmp_path):
    model, tokenizer = _release(tmp_path)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        _trainer(tmp_path, model, tokenizer, max_steps=1, router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="loaded Spider model"):
        SpiderSFTTrainer(
            model=str(tmp_path / "release"), args=SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False)
        )


def test_readme_peft_trl_recipe_runs_as_written(tmp_path):
    _release(tmp_path)
    run_readme_recipe("peft-trl", tmp_path / "release", tmp_path)
    assert_lora_adapters_trained(tmp_path / "runs/spider-sft/adapter/adapter_model.safetensors")
