"""transformers' own common suites (ModelTesterMixin, ConfigTester) run against Spider, plus generation tests.

The suites come from the transformers sdist of the installed version (see ``tests/hf_suites.py``). Skips are limited
to what cannot apply to Spider, each with its reason.
"""

import json
import unittest
import unittest.mock

import torch
from transformers import pipeline
from transformers.models.auto import modeling_auto

from configuration_spider import SpiderConfig
from modeling_spider import SpiderForConditionalGeneration, SpiderModel
from tests.helpers import float_tol, model_terms
from tests.hf_suites import suite_class
from tokenization_spider import SpiderTokenizer

ModelTesterMixin = suite_class("test_modeling_common", "ModelTesterMixin")
GenerationTesterMixin = suite_class("test_modeling_common", "GenerationTesterMixin")
ConfigTester = suite_class("test_configuration_common", "ConfigTester")


class SpiderModelTester:
    """Builds tiny configs and inputs for the common suite (its `model_tester` protocol)."""

    def __init__(self, parent, batch_size=2, seq_length=12, is_training=True):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = 272
        self.hidden_size = 32
        self.num_hidden_layers = 2  # 1 prelude + 1 recurrent (the suite caps layers at 2; coda: tests/test_components)
        self.num_attention_heads = 2
        # output_hidden_states gives byte states: embeddings, each prelude layer, the expanded recurrent output and
        # each coda layer (the recurrent layers run on segments, a different length).
        self.expected_num_hidden_layers = 1 + 1 + 1

    def get_config(self):
        return SpiderConfig.from_preset(
            "tiny",
            hidden_size=self.hidden_size,
            intermediate_size=64,
            num_attention_heads=self.num_attention_heads,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            moe_intermediate_size=16,
            n_routed_experts=4,
            engram_head_dim=8,
            engram_table_size=101,
            loop_adapter_rank=4,
            max_position_embeddings=64,
            num_prelude_layers=1,
            num_recurrent_layers=1,
            num_coda_layers=0,
            engram_layer_ids=[0],
        )

    def prepare_config_and_inputs(self):
        input_ids = torch.randint(0, 256, (self.batch_size, self.seq_length))
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :3] = 0  # one left-padded row
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class SpiderModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (SpiderModel, SpiderForConditionalGeneration)
    all_generative_model_classes = (SpiderForConditionalGeneration,)
    pipeline_model_mapping = {}
    has_attentions = True
    test_resize_embeddings = False  # the 272-id byte vocabulary is fixed (docs/design.md, "Vocabulary")
    test_all_params_have_gradient = True

    @classmethod
    def setUpClass(cls):
        # The suite decides which classes get labels / are base models by name in these mappings; out-of-tree
        # models are not in them (Auto*.register does not add to them).
        cls._added = []
        for mapping, name in (
            (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "SpiderForConditionalGeneration"),
            (modeling_auto.MODEL_MAPPING_NAMES, "SpiderModel"),
        ):
            if "spider" not in mapping:
                mapping["spider"] = name
                cls._added.append(mapping)

    @classmethod
    def tearDownClass(cls):
        for mapping in cls._added:
            mapping.pop("spider", None)

    def setUp(self):
        self.model_tester = SpiderModelTester(self)
        self.config_tester = ConfigTester(
            self,
            config_class=SpiderConfig,
            hidden_size=32,
            common_properties=[
                "hidden_size",
                "num_attention_heads",
                "num_hidden_layers",
                "vocab_size",
            ],
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_batching_equivalence(self):
        """The suite's version compares every float output row by row, but `expert_load` (E,) is a statistic of the
        whole batch, not of a row. Same check, per-row outputs only (logits, last_hidden_state, hidden_states)."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_hidden_states = True
        for model_class in self.all_model_classes:
            torch.manual_seed(42)
            model = model_class(config).eval()
            with torch.no_grad():
                batched = model(**inputs)
                row = model(**{k: v[:1] for k, v in inputs.items()})
            for key in ("logits", "last_hidden_state"):
                if batched.get(key) is not None:
                    torch.testing.assert_close(batched[key][:1], row[key], **float_tol(row[key], model_terms(model)))
            for b, r in zip(batched.hidden_states, row.hidden_states, strict=True):
                torch.testing.assert_close(b[:1], r, **float_tol(r, model_terms(model)))

    def test_attention_outputs(self):
        """The common test's checks, for Spider's layout: one weight tensor per attention call -- each prelude
        layer `(B, H, L, L)`, each (loop, recurrent layer) `(B, H, 1+S, 1+S)` over segments, each coda layer -- so
        `num_prelude_layers + num_recurrent_layers * n_loops + num_coda_layers` of them (not `num_hidden_layers`);
        asked for by argument or by config, as a tuple with `return_dict=False`."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        B, L = inputs["input_ids"].shape
        calls = config.num_prelude_layers + config.num_recurrent_layers * config.n_loops + config.num_coda_layers
        for model_class in self.all_model_classes:
            model = model_class._from_config(config, attn_implementation="eager").eval()
            base = model if model_class is SpiderModel else model.model
            with torch.no_grad():
                segments = int(base(**inputs).boundaries.sum(1).max()) + 1
                by_argument = model(**inputs, output_attentions=True).attentions
                model.config.output_attentions = True
                by_config = model(**inputs).attentions
                as_tuple = model(**inputs, return_dict=False)
            model.config.output_attentions = False
            for attentions in (by_argument, by_config):
                self.assertEqual(len(attentions), calls)
                byte_calls = list(attentions[: config.num_prelude_layers])
                byte_calls += list(attentions[len(attentions) - config.num_coda_layers :])
                for weights in byte_calls:
                    self.assertEqual(weights.shape, (B, config.num_attention_heads, L, L))
                for weights in attentions[config.num_prelude_layers : len(attentions) - config.num_coda_layers]:
                    self.assertEqual(weights.shape, (B, config.num_attention_heads, segments, segments))
            self.assertTrue(any(isinstance(x, tuple) and len(x) == calls for x in as_tuple))

    def test_moe_models_record_router_logits(self):
        """The common test wants `router_logits` among the outputs `capture_outputs` records, so that
        `output_router_logits=True` returns them. Spider collects them itself, one `(N, E)` tensor per (loop, recurrent
        layer) including the empty ones of layers every segment has left (`act_early_exit`), which a forward hook on
        the MoE would not see; the same promise, checked directly: every class returns them, in its output type."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        calls = config.num_recurrent_layers * config.n_loops
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            with torch.no_grad():
                out = model(**inputs, output_router_logits=True)
            self.assertIn("router_logits", type(out).__dataclass_fields__)
            router_logits = out.router_logits
            self.assertEqual(len(router_logits), calls)
            self.assertTrue(all(r.shape[-1] == config.n_routed_experts for r in router_logits))

    def test_reverse_loading_mapping(self):
        """The common test saves with `save_pretrained()`'s default and expects the registered conversion reversed,
        which is transformers' default (`save_original_format=True`). Spider's `save_pretrained` writes its own fused
        names by default; the same test, run with transformers' default, checks the reverse mapping (the per-expert
        layout of older releases) and its reload."""
        from transformers import PreTrainedModel

        def save_original_format(model, *args, **kwargs):
            return PreTrainedModel.save_pretrained(model, *args, **{"save_original_format": True, **kwargs})

        with (
            unittest.mock.patch.object(SpiderForConditionalGeneration, "save_pretrained", save_original_format),
            unittest.mock.patch.object(SpiderModel, "save_pretrained", save_original_format),
        ):
            super().test_reverse_loading_mapping()

    # The suite's parameterized RoPE test feeds 1.5x max_position_embeddings bytes, which Spider refuses (an input
    # check); test_rope_parameters_pick_transformers_rope below checks the scaled RoPE types within range.
    _ROPE_SKIP = unittest.skip("feeds more than max_position_embeddings bytes, which Spider refuses")
    test_model_rope_scaling_from_config_0_linear = _ROPE_SKIP(lambda self: None)
    test_model_rope_scaling_from_config_1_dynamic = _ROPE_SKIP(lambda self: None)
    test_model_rope_scaling_from_config_2_yarn = _ROPE_SKIP(lambda self: None)

    @unittest.skip("Engram memory hashes the byte ids, so Spider needs input_ids; inputs_embeds alone cannot work")
    def test_inputs_embeds(self):
        pass

    @unittest.skip("Engram memory hashes the byte ids, so Spider needs input_ids; inputs_embeds alone cannot work")
    def test_inputs_embeds_matches_input_ids(self):
        pass


class SpiderGenerationTest(unittest.TestCase):
    """Generation, which the suite's GenerationTesterMixin stand-in does not cover."""

    def setUp(self):
        torch.manual_seed(0)
        self.model = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny")).eval()
        self.tok = SpiderTokenizer()

    def manual_greedy(self, ids, steps, n_loops=None):
        ids = ids.clone()
        for _ in range(steps):
            with torch.no_grad():
                nxt = self.model(ids, n_loops=n_loops).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        return ids

    def test_greedy_matches_manual_loop_and_passes_n_loops(self):
        ids = torch.tensor([[257] + list(b"Four score")])
        for n_loops in (1, 3):
            out = self.model.generate(ids, max_new_tokens=8, do_sample=False, n_loops=n_loops, eos_token_id=None)
            self.assertTrue(torch.equal(out, self.manual_greedy(ids, 8, n_loops)))
        one = self.model.generate(ids, max_new_tokens=8, do_sample=False, n_loops=1, eos_token_id=None)
        four = self.model.generate(ids, max_new_tokens=8, do_sample=False, n_loops=4, eos_token_id=None)
        logits1 = self.model(one, n_loops=1).logits
        logits4 = self.model(one, n_loops=4).logits
        self.assertGreater((logits1 - logits4).abs().max().item(), 1e-4)  # n_loops reaches the forward
        self.assertEqual(one.shape, four.shape)

    def test_sampling_and_max_new_tokens(self):
        ids = torch.tensor([[257] + list(b"We the people")])
        torch.manual_seed(1)
        a = self.model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20, eos_token_id=None)
        torch.manual_seed(1)
        b = self.model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20, eos_token_id=None)
        self.assertEqual(a.shape[1], ids.shape[1] + 12)
        self.assertTrue(torch.equal(a, b))

    def test_eos_stops_generation(self):
        ids = torch.tensor([[257] + list(b"abc")])
        first = self.manual_greedy(ids, 1)[0, -1].item()
        out = self.model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=first, pad_token_id=256)
        self.assertEqual(out.shape[1], ids.shape[1] + 1)
        self.assertEqual(out[0, -1].item(), first)

    def test_text_generation_pipeline(self):
        generator = pipeline("text-generation", model=self.model, tokenizer=self.tok)
        result = generator("Hello", max_new_tokens=5, do_sample=False)
        self.assertTrue(result[0]["generated_text"].startswith("Hello"))
        expected = self.manual_greedy(torch.tensor([self.tok("Hello")["input_ids"]]), 5)
        ref_text = self.tok.decode(expected[0], skip_special_tokens=True)
        self.assertEqual(result[0]["generated_text"], ref_text)


def test_rope_parameters_pick_transformers_rope(tmp_path):
    """RoPE comes from `config.rope_parameters` through transformers' `ROPE_INIT_FUNCTIONS`: linear scaling divides
    every frequency by its factor and changes the outputs; a config.json written with `rope_theta` (older releases)
    loads into `rope_parameters` with the same frequencies."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    default = SpiderForConditionalGeneration(SpiderConfig.from_preset("tiny")).eval()
    torch.manual_seed(0)
    linear = SpiderForConditionalGeneration(
        SpiderConfig.from_preset("tiny", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    ).eval()
    default_freq, linear_freq = default.model.rotary_emb.inv_freq, linear.model.rotary_emb.inv_freq
    assert default_freq.shape == (default.config.qk_rope_head_dim // 2,)
    torch.testing.assert_close(linear_freq, default_freq / 2.0, rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.equal(default(ids).logits, linear(ids).logits)

    default.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 10000.0
    config.pop("rope_parameters")
    config["rope_theta"] = 500000.0  # the older field
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = SpiderForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    expected = 1.0 / (
        500000.0 ** (torch.arange(0, loaded.config.qk_rope_head_dim, 2).float() / loaded.config.qk_rope_head_dim)
    )
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)


def test_older_config_key_lora_rank_loads_as_loop_adapter_rank(tmp_path):
    """The per-loop adapter's rank was `lora_rank` (which read as PEFT's LoRA): configs written with it still load,
    arguments and overrides with it still apply, and new configs write `loop_adapter_rank`."""
    config = SpiderConfig.from_preset("tiny", lora_rank=8)
    assert config.loop_adapter_rank == 8 and config.lora_rank == 8
    config.update_from_string("lora_rank=4")
    assert config.loop_adapter_rank == 4
    saved = config.to_dict()
    assert "lora_rank" not in saved and saved["loop_adapter_rank"] == 4
    saved.pop("loop_adapter_rank")
    (tmp_path / "config.json").write_text(json.dumps({**saved, "lora_rank": 2}))
    loaded = SpiderConfig.from_pretrained(tmp_path)
    assert loaded.loop_adapter_rank == 2
    assert SpiderForConditionalGeneration(loaded).model.recurrent_block.loop_lora.lora_A.shape[0] == 2


def test_older_config_keys_upsample_load_as_expand_fields(tmp_path):
    """The expansion's fields were `upsample_mixing`, `upsample_scale_init` and `upsample_rms_ratio` (one vocabulary
    since: segments are pooled from bytes and expanded back, docs/design.md's glossary): config.json files, arguments
    and overrides with the older keys still load into the new fields, and new configs write only the new keys."""
    config = SpiderConfig.from_preset("tiny", upsample_mixing="rms_matched", upsample_rms_ratio=0.3)
    assert (config.expand_mixing, config.expand_rms_ratio) == ("rms_matched", 0.3)
    config.update_from_string("upsample_scale_init=0.25")
    assert config.expand_scale_init == 0.25
    saved = config.to_dict()
    assert not any(key.startswith("upsample_") for key in saved)
    old = {key.replace("expand_", "upsample_"): value for key, value in saved.items()}
    (tmp_path / "config.json").write_text(json.dumps({**old, "upsample_mixing": "residual_proj"}))
    loaded = SpiderConfig.from_pretrained(tmp_path)
    assert (loaded.expand_mixing, loaded.expand_scale_init, loaded.expand_rms_ratio) == ("residual_proj", 0.25, 0.3)
    assert not any(key.startswith("expand_") for key in old)
    assert hasattr(SpiderForConditionalGeneration(loaded).model.flexitokens, "residual_proj")
