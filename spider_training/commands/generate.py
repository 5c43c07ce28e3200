"""Sample text from a Spider model: ``python -m spider_training.commands.generate [--model PATH] --prompt TEXT``.

With ``--model`` it loads a saved folder (a training release or checkpoint) through the Auto classes with
``trust_remote_code=True``, exactly as a user of the Hub would; without it, it builds a fresh model from a preset
(untrained: the output is noise, which is what a demo of the plumbing shows).
"""

from __future__ import annotations

import argparse

import torch


def load(model_path: str | None, preset: str = "tiny"):
    """Return `(model, tokenizer)` in eval mode: from `model_path` via AutoModelForCausalLM/AutoTokenizer, or fresh."""
    if model_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..release import checked_from_pretrained

        model = checked_from_pretrained(AutoModelForCausalLM.from_pretrained, model_path, trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=True)
    else:
        from configuration_spider import SpiderConfig
        from modeling_spider import SpiderForConditionalGeneration
        from tokenization_spider import SpiderTokenizer

        model = SpiderForConditionalGeneration(SpiderConfig.from_preset(preset))
        tokenizer = SpiderTokenizer()
    return model.eval(), tokenizer


def sample(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    n_loops: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> str:
    """Continue `prompt` by up to `max_new_tokens` bytes and return the decoded continuation (EOS stops early).

    The model generates in eval mode (deterministic boundaries, the KV cache) and is put back in its former mode.
    The prompt's ids are built on the model's device (``model.device``: CUDA when the model was trained there)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tokenizer.bos_token_id, *prompt_ids]], dtype=torch.long, device=model.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                n_loops=n_loops,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_k=top_k,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="saved Spider folder; default: a fresh model from --preset")
    parser.add_argument("--preset", default="tiny", help="preset of the fresh model (tiny, small, 1b)")
    parser.add_argument("--prompt", default="The state of the union is")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--n_loops", type=int, default=None)
    parser.add_argument("--do_sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=None)
    args = parser.parse_args(argv)
    model, tokenizer = load(args.model, args.preset)
    text = sample(
        model, tokenizer, args.prompt, args.max_new_tokens, args.n_loops, args.do_sample, args.temperature, args.top_k
    )
    print(repr(args.prompt + text))


if __name__ == "__main__":
    main()
