"""The accelerate launch configs in configs/accelerate/, read by accelerate's own loaders."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType

import modeling_spider

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"

EXPECTED = {
    "single_process.yaml": dict(distributed_type=DistributedType.NO, num_processes=1, num_machines=1),
    "ddp_cpu.yaml": dict(distributed_type=DistributedType.MULTI_GPU, num_processes=2, num_machines=1),
    "ddp.yaml": dict(distributed_type=DistributedType.MULTI_GPU, num_processes=8, num_machines=1),
    "fsdp2.yaml": dict(distributed_type=DistributedType.FSDP, num_processes=8, num_machines=1),
    "multi_node.yaml": dict(distributed_type=DistributedType.FSDP, num_processes=16, num_machines=2),
}


def test_every_config_in_the_folder_is_checked_here():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    config = load_config_from_file(str(CONFIGS / name))
    for field, value in EXPECTED[name].items():
        assert getattr(config, field) == value, (name, field)
    assert config.mixed_precision == "no"  # train_hf.py's --precision decides (torchao FP8 or bf16)
    if config.distributed_type == DistributedType.FSDP:
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        # the wrap policy names real layer classes: every repeated layer of the model, as _no_split_modules does
        layers = fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
        assert all(isinstance(getattr(modeling_spider, cls, None), type) for cls in layers), layers
        assert sorted(layers) == sorted(modeling_spider.SpiderPreTrainedModel._no_split_modules)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_launch_command_accepts_config(name):
    """accelerate launch's own argument merging takes each file (what `accelerate launch --config_file` does first)."""
    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "train_hf.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes == EXPECTED[name]["num_processes"]
    assert bool(args.use_fsdp) == (EXPECTED[name]["distributed_type"] == DistributedType.FSDP)
    if args.use_fsdp:
        assert str(args.fsdp_version) == "2"
