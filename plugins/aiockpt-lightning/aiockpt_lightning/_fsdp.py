"""AiockptFSDPStrategy: Lightning's FSDPStrategy, saving and resuming sharded through aiockpt.

Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``) writes a sharded checkpoint
with ``torch.distributed.checkpoint`` and a full one with ``torch.load``/``torch.save`` on rank 0,
in either case without its ``CheckpointIO``. This subclass routes both directions through
:class:`AiockptCheckpointIO`: every rank saves its own part of one aiockpt checkpoint (the
model's and the optimizers' state as DTensors, the rest from global rank 0), committed once
every part has landed, and a resume reshards it onto this run's ranks. It also runs on the CPU
with gloo, which ``FSDPStrategy`` refuses.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.fsdp import (
    _move_torchmetrics_to_device,
    _setup_activation_checkpointing,
)
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from ._io import AiockptCheckpointIO

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["AiockptFSDPStrategy"]

#: The top-level keys of a Lightning checkpoint that every rank saves its part of.
SHARDED_KEYS = ("state_dict", "optimizer_states")
#: The precisions tested on the CPU: the mixed ones autocast for CUDA, and FSDP's
#: half-precision parameters on the CPU are untried.
CPU_PRECISIONS = ("32-true",)


class AiockptFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` whose checkpoints go through :class:`AiockptCheckpointIO`, sharded.

    ``Trainer(strategy=AiockptFSDPStrategy(), plugins=[AiockptCheckpointIO(root)])``. Takes
    ``FSDPStrategy``'s arguments, by keyword, except ``state_dict_type`` (always ``"sharded"``) and
    ``process_group`` (give ``device_mesh``): FSDP gives its state as DTensors only when it
    runs on a device mesh, so one of the whole job is made when none is given.

    A save is collective, as ``FSDPStrategy``'s sharded save is: each rank saves its DTensor
    chunks of the model's and optimizers' state (``torch.distributed.checkpoint.state_dict``'s
    ``get_model_state_dict`` and ``get_optimizer_state_dict``) into one aiockpt checkpoint,
    global rank 0 also the rest of Lightning's checkpoint, and rank 0 writes the pointer file
    once the checkpoint has committed. A load reads the pointer on rank 0, and each rank
    restores its own chunks in place, resharded to this run's mesh and world size.

    On the CPU it runs with gloo and ``precision="32-true"``; CPU offloading is refused there
    (the parameters are on the CPU already).
    """

    strategy_name = "aiockpt_fsdp"

    def __init__(self, *, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        if state_dict_type != "sharded":
            raise ValueError(
                f"AiockptFSDPStrategy saves sharded, not state_dict_type={state_dict_type!r}: "
                "each rank saves its own part, and the checkpoint loads on any number of "
                "processes (whole, outside a distributed run)"
            )
        if kwargs.get("process_group") is not None:
            raise ValueError(
                "AiockptFSDPStrategy takes a device_mesh, not a process_group: FSDP gives its "
                "state as DTensors, which aiockpt saves sharded, only on a device mesh"
            )
        super().__init__(state_dict_type="sharded", **kwargs)
        if self.sharding_strategy.name.lstrip("_").startswith("HYBRID") and (
            self.kwargs.get("device_mesh") is None
        ):
            raise ValueError(
                f"AiockptFSDPStrategy with {self.sharding_strategy.name} needs a 2-D "
                "device_mesh=(replicas, shards): FSDP gives its state as DTensors only on a mesh"
            )

    # ----------------------------------------------------------------- the CPU

    def setup_environment(self) -> None:
        """Lightning's set-up, then the device mesh (made on this run's device type)."""
        if self.root_device.type == "cpu":
            _check_cpu(self)
        shape = self.kwargs.pop("device_mesh", None)
        super().setup_environment()
        if shape is None or isinstance(shape, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            shape = shape if shape is not None else (self.world_size,)
            shape = init_device_mesh(self.root_device.type, shape)
        self.kwargs["device_mesh"] = shape

    def _setup_model(self, model: Module) -> Module:
        """As ``FSDPStrategy``'s, with the CPU named as FSDP's device there (FSDP takes a
        module on the CPU given no device for one to be moved to an accelerator)."""
        if self.root_device.type != "cpu":
            return super()._setup_model(model)
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(mod, FullyShardedDataParallel) for mod in model.modules()):
            if _has_meta_device_parameters_or_buffers(model):
                rank_zero_warn(
                    "The model is already wrapped in `FSDP` but there are still parameters on "
                    "the meta device."
                )
            if "auto_wrap_policy" in self.kwargs:
                rank_zero_warn(
                    "A FSDP `auto_wrap_policy` is set, but the model is already wrapped. The "
                    "policy will be ignored."
                )
                del self.kwargs["auto_wrap_policy"]
        else:
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self.kwargs,
            )
        _move_torchmetrics_to_device(model, self.root_device)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """As ``FSDPStrategy``'s, with the CPU named as FSDP's device there."""
        if self.root_device.type != "cpu":
            with super().model_sharded_context():
                yield
            return
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        ):
            yield

    # ----------------------------------------------------------------- state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model's state: DTensors, keyed as the LightningModule's
        own ``state_dict()`` (collective)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return dict(get_model_state_dict(self.model, options=_options()))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state: DTensors, keyed by parameter name
        (collective)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return dict(get_optimizer_state_dict(self.model, optimizer, options=_options()))

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` at ``filepath`` (rank 0's path counts), every rank its part;
        returns once aiockpt has taken each rank's snapshot (collective)."""
        if storage_options is not None:
            raise TypeError(
                "AiockptFSDPStrategy.save_checkpoint takes no storage_options: give aiockpt's "
                "to AiockptCheckpointIO(root, storage_options=...)"
            )
        path = self.broadcast(filepath)
        sharded = tuple(k for k in SHARDED_KEYS if k in checkpoint)
        self._aiockpt_io()._save_sharded(checkpoint, path, sharded)

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the model (and, when fitting, the optimizers) from the checkpoint at
        ``checkpoint_path`` (rank 0's path counts), each rank its own chunks; the whole
        checkpoint dict, its model and optimizer states as this rank's DTensors
        (collective). ``weights_only`` changes nothing: nothing is unpickled."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(checkpoint_path)
        assert self.model is not None
        assert self.lightning_module is not None
        strict = bool(self.lightning_module.strict_loading)
        targets: dict[str, Any] = {
            "state_dict": dict(get_model_state_dict(self.model, options=_options()))
        }
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and self.optimizers:
            # A fresh optimizer's state is made first (one step of zero gradients at a
            # learning rate of 0), so that each moment has its DTensor to restore into.
            targets["optimizer_states"] = [
                dict(get_optimizer_state_dict(self.model, opt, options=_options()))
                for opt in self.optimizers
            ]
        # (The optimizers' states are not read when they are not restored.)
        checkpoint = self._aiockpt_io()._load_sharded(path, targets, strict, skip=SHARDED_KEYS)
        set_model_state_dict(self.model, checkpoint["state_dict"], options=_options(strict))
        if "optimizer_states" in targets:
            for opt, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
                set_optimizer_state_dict(self.model, opt, state, options=_options(strict))
        return checkpoint

    def teardown(self) -> None:
        """``FSDPStrategy``'s teardown, then the plugin's (which ``FSDPStrategy`` skips):
        every save committed and its pointer written, the aiockpt managers closed."""
        super().teardown()
        self.checkpoint_io.teardown()

    def _aiockpt_io(self) -> AiockptCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, AiockptCheckpointIO):
            raise TypeError(
                "AiockptFSDPStrategy saves through AiockptCheckpointIO, not "
                f"{type(io).__name__}: Trainer(strategy=AiockptFSDPStrategy(), "
                "plugins=[AiockptCheckpointIO(root)]) (not wrapped in AsyncCheckpointIO: every "
                "rank saves its part at once)"
            )
        return io


def _options(strict: bool = True) -> StateDictOptions:
    """The state dicts' options: sharded (DTensors), left on their device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=strict)


def _check_cpu(strategy: AiockptFSDPStrategy) -> None:
    """Refuse on the CPU what FSDP is not known to do right there."""
    if strategy.cpu_offload is not None and strategy.cpu_offload.offload_params:
        raise ValueError(
            "AiockptFSDPStrategy(cpu_offload=True) on the CPU: the parameters are on the CPU "
            "already, there is nothing to offload"
        )
    precision = strategy.precision_plugin.precision
    if precision not in CPU_PRECISIONS:
        raise ValueError(
            f"AiockptFSDPStrategy on the CPU runs with precision='32-true', not {precision!r} "
            "(FSDP's mixed precision autocasts for CUDA)"
        )
    backend = strategy._get_process_group_backend()
    if backend != "gloo":
        raise ValueError(f"AiockptFSDPStrategy on the CPU needs the gloo backend, not {backend!r}")
