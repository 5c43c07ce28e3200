"""Fine-tuning a Spider release with TRL's ``SFTTrainer``, keeping every one of Spider's loss terms."""

from __future__ import annotations

import copy

from trl import SFTConfig, SFTTrainer

#: Spider's loss terms besides the language-model loss -> the config coefficient that weighs each one (the sum is
#: ``SpiderForConditionalGeneration``'s loss).
SPIDER_LOSS_TERMS = {
    "aux_loss": "router_aux_loss_coef",
    "boundary_loss": "boundary_loss_coef",
    "ponder_loss": "ponder_loss_coef",
}


class SpiderSFTTrainer(SFTTrainer):
    """TRL's ``SFTTrainer`` for Spider: the loss is Spider's own, `lm_loss + router_aux_loss_coef * aux_loss +
    boundary_loss_coef * boundary_loss + ponder_loss_coef * ponder_loss` (``SpiderForConditionalGeneration``'s),
    with the language-model part from TRL's fused LM head (no full logits).

    Plain ``SFTTrainer`` gets two things wrong with Spider: its fused forward returns the language-model loss only,
    so Spider's FlexiTokens boundary-rate, ACT ponder and MoE balancing terms are dropped; and a config with
    ``router_aux_loss_coef`` and ``output_router_logits`` is taken for Mixtral's, whose balancing loss expects one
    router row per token (Spider routes segments: a size mismatch). This trainer turns TRL's Mixtral loss off
    (``router_aux_loss_coef=0.0`` on a copy of `args`), puts the model config's coefficient back so the saved config is
    the release's, and adds Spider's terms, computed by the LM head's ``loss_terms`` from the backbone's output (a
    forward hook on ``SpiderModel``: TRL's fused loss skips the head), averaged over gradient-accumulation steps as
    TRL averages its own auxiliary loss. Each term is logged under its name.

    Args: as ``SFTTrainer``; `model` a Spider model (a ``PreTrainedModel`` whose base model is a ``SpiderModel``).
    Raises: ``ValueError`` if `args.router_aux_loss_coef` is set to a non-zero value (Spider weighs its balancing loss
    by ``config.router_aux_loss_coef``: set it there), or if `model` holds no ``SpiderForConditionalGeneration``.
    """

    def __init__(self, model, args: SFTConfig | None = None, **kwargs):
        if isinstance(model, str):
            raise ValueError(
                "SpiderSFTTrainer takes a loaded Spider model: pass "
                "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True), not a path"
            )
        args = copy.copy(args) if args is not None else SFTConfig()
        if args.router_aux_loss_coef:
            raise ValueError(
                f"SFTConfig.router_aux_loss_coef={args.router_aux_loss_coef}: TRL's coefficient applies "
                "Mixtral's per-token balancing loss; Spider weighs its own by "
                "model.config.router_aux_loss_coef, set it there"
            )
        self.spider_loss_coefs = {term: float(getattr(model.config, name)) for term, name in SPIDER_LOSS_TERMS.items()}
        args.router_aux_loss_coef = 0.0
        super().__init__(model, args=args, **kwargs)
        model.config.router_aux_loss_coef = self.spider_loss_coefs["aux_loss"]  # TRL wrote 0.0 there
        heads = [m for m in self.model.modules() if type(m).__name__ == "SpiderForConditionalGeneration"]
        if not heads:
            raise ValueError(
                f"SpiderSFTTrainer needs a Spider model; {type(model).__name__} holds no "
                "SpiderForConditionalGeneration"
            )
        self._spider_head, self._spider_outputs = heads[0], None
        heads[0].model.register_forward_hook(self._record_spider_outputs, with_kwargs=True)

    def _record_spider_outputs(self, module, args, kwargs, outputs):
        if self._spider_outputs is None:  # the first forward of this compute_loss is the one that carries the loss
            input_ids = args[0] if args else kwargs["input_ids"]
            # TRL's fused loss runs the backbone, not the head: the head's loss terms from the backbone's output
            self._spider_outputs = self._spider_head.loss_terms(outputs, input_ids, kwargs.get("attention_mask"))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss plus Spider's weighted terms (see the class docstring)."""
        self._spider_outputs = None
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        loss, outputs = result if return_outputs else (result, None)
        recorded, self._spider_outputs = self._spider_outputs, None
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        mode = "train" if self.model.training else "eval"
        for term, coef in self.spider_loss_coefs.items():
            value = recorded[term]
            self._metrics[mode][term].append(float(value.detach()))
            if coef:
                loss = loss + coef * value / steps
        return (loss, outputs) if return_outputs else loss
