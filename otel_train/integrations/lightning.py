"""PyTorch Lightning: a `Logger` for `self.log(...)` values and a `Callback` for spans.

Usage::

    from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger

    trainer = Trainer(logger=OtelTrainLogger(), callbacks=[OtelTrainCallback()])

What appears where:

- `OtelTrainLogger`: every value Lightning hands its loggers (``self.log(..., logger=True)``, every
  ``log_every_n_steps`` training steps, and at epoch ends) becomes a gauge of the same name at the step
  Lightning gives (`trainer.global_step` while training); the LightningModule's / DataModule's saved
  hyperparameters become the run config (TensorBoard HParams, W&B config, ...).
- `OtelTrainCallback`: spans ``train/epoch``, ``train/batch`` (inside ``otel_train.step(global_step)``, so
  step durations and step-aligned export come with it), ``val/epoch``, ``val/batch``, ``test/epoch``,
  ``test/batch`` and ``checkpoint/save``, each with ``train.step`` = `trainer.global_step`. A ``fit`` resumed
  from a checkpoint (``ckpt_path=``) restarts the run at the restored `trainer.global_step` G (the step of
  the first new batch and of the values it logs): `otel_train.resume(G)` at `on_train_start`, so every
  backend supersedes the earlier attempt's steps >= G.

Both call `otel_train.init()` (env configuration) when the user has not, with Lightning's global rank,
local rank and world size; `OTEL_TRAIN_RANKS` decides which ranks export metrics (spans come from
every rank). A session they started is flushed when a stage ends and shut down at interpreter exit, so
``fit`` then ``test`` write one run. Lightning itself turns logged tensors into numbers before it calls
any logger; this logger adds no `.item()` of its own.

This module imports ``lightning.pytorch`` (else ``pytorch_lightning``); ``import otel_train`` does not.
"""

from __future__ import annotations

import functools
import signal
import threading
from argparse import Namespace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import otel_train as ot
from otel_train.integrations._hooks import HookSpans, HookStep, log_step, numeric
from otel_train.integrations._session import OwnedSession

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger
except ImportError:
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[assignment,no-redef,unused-ignore]
        from pytorch_lightning.loggers import Logger  # type: ignore[assignment,no-redef,unused-ignore]
    except ImportError as err:
        raise ModuleNotFoundError(
            "otel_train.integrations.lightning needs PyTorch Lightning: pip install 'otel-train[lightning]'",
            name="lightning",
        ) from err
# Both packages' strategies set this one's `rank` to the global rank (a dependency of both).
from lightning_utilities.core.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["OtelTrainCallback", "OtelTrainLogger"]


def _hyperparameters(params: Mapping[str, Any] | Namespace) -> dict[str, Any]:
    """Lightning passes a dict, an `AttributeDict` or an argparse `Namespace`."""
    return dict(vars(params)) if isinstance(params, Namespace) else dict(params)


class OtelTrainLogger(Logger):
    """A Lightning `Logger` that sends logged values and hyperparameters to otel-train.

    Lightning applies `log_every_n_steps` before calling loggers, so every call here is written.
    Values are logged on every rank that Lightning calls; `OTEL_TRAIN_RANKS` (default ``0``) decides
    which ranks' values are exported. Alone, the logger lets otel-train collect every
    `OTEL_TRAIN_EXPORT_INTERVAL_S` and at each stage's end (Lightning's TensorBoardLogger flushes every
    120 s); with `OtelTrainCallback`, collection follows steps (`OTEL_TRAIN_EXPORT_EVERY`).

    Example:
        >>> from otel_train.integrations.lightning import OtelTrainLogger  # doctest: +SKIP
        >>> trainer = Trainer(logger=OtelTrainLogger(), log_every_n_steps=10)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self._owned = OwnedSession()

    def _ensure(self) -> None:
        # Lightning's strategy sets `rank_zero_only.rank` to the global rank before loggers are used, and has
        # started the process group by then (a logger knows no trainer): with both, a user's `init()` that ran
        # before Lightning launched the ranks moves to Lightning's place (rank 0 included).
        self._owned.ensure(rank=getattr(rank_zero_only, "rank", None), world_size=_process_group_size())

    @property
    def name(self) -> str:
        """Empty: checkpoints go to ``<OTEL_TRAIN_DIR>/<run name>/checkpoints``, beside the run's events."""
        return ""

    @property
    def version(self) -> str:
        """The otel-train run name (starts the session if needed: Lightning asks for it during setup)."""
        self._ensure()
        run = getattr(ot.current_session(), "run", None)
        return getattr(run, "run_name", None) or "otel-train"

    @property
    def save_dir(self) -> str | None:
        """`OTEL_TRAIN_DIR` of the running session."""
        self._ensure()
        settings = getattr(ot.current_session(), "settings", None)
        return None if settings is None else str(settings.dir)

    @property
    def experiment(self) -> Any:
        """The otel-train session (what `otel_train.init()` returned)."""
        self._ensure()
        return ot.current_session()

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Record `params` as the run config (before training: every backend receives it)."""
        config = _hyperparameters(params)
        self._ensure()
        self._owned.add_config(config)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record each number (or tensor) of `metrics` as a gauge at `step`."""
        self._ensure()
        log_step(numeric(metrics), step)  # a logged step is a step boundary: collection follows Lightning's log

    def finalize(self, status: str) -> None:
        """End of a stage (``success``/``failed``): make everything logged so far durable."""
        ot.flush()


def _process_group_size() -> int | None:
    """The world size of the started `torch.distributed` process group, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _requeue_signal(trainer: Trainer) -> int | None:
    """The signal Lightning's SLURM auto-requeue handler will take, or None when it will install none."""
    try:
        from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
    except ImportError:
        try:  # the `pytorch_lightning` package's own copy
            from lightning_fabric.plugins.environments.slurm import (  # type: ignore[assignment,no-redef,unused-ignore]
                SLURMEnvironment,
            )
        except ImportError:
            return None
    # A parallel strategy holds Lightning's cluster environment (public); a single-device one does not, and
    # Lightning then uses a `SLURMEnvironment` with its defaults (auto-requeue on SIGUSR1) where SLURM is detected.
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None:
        return int(signal.SIGUSR1) if SLURMEnvironment.detect() else None
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    return int(environment.requeue_signal or signal.SIGUSR1)


class _FlushThenRequeue:
    """otel-train's hand-off (composed so, it only flushes), then Lightning's requeue handler: what was
    logged is durable before the job is requeued (which ends it)."""

    def __init__(self, ours: Any, theirs: Any) -> None:
        self.ours = ours
        self.theirs = theirs

    def __call__(self, signum: int, frame: Any) -> None:
        try:
            self.ours(signum, frame)
        finally:
            self.theirs(signum, frame)


class OtelTrainCallback(Callback):
    """A Lightning `Callback` that times epochs, batches and checkpoint saves as spans.

    Train batches run inside ``otel_train.step(trainer.global_step)``, so `ot.log` calls and spans in
    user code during a batch carry its step, and step-aligned export follows training.

    Example:
        >>> trainer = Trainer(callbacks=[OtelTrainCallback()])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._owned = OwnedSession()
        self._spans = HookSpans()
        self._step = HookStep()
        self._save_checkpoint: Any = None
        self._released: tuple[int, Any, Any] | None = None  # (signal, otel-train's handler, the one released to)

    # -- lifecycle ---------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._owned.ensure(rank=trainer.global_rank, local_rank=trainer.local_rank, world_size=trainer.world_size)
        if self._save_checkpoint is None:
            self._wrap_checkpoint_saves(trainer)
        self._release_requeue_signal(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._step.end()
        self._spans.end_all()
        if self._save_checkpoint is not None:
            trainer.save_checkpoint = self._save_checkpoint  # type: ignore[method-assign]
            self._save_checkpoint = None
        self._reclaim_requeue_signal()
        ot.flush()

    # -- SLURM auto-requeue -----------------------------------------------------------------------------
    # Lightning installs its requeue handler only where the signal still has the default one, and it
    # registers its handlers after `setup`: otel-train's (from `init()`) would make it skip requeueing.
    # So, with auto-requeue on, ours steps aside before Lightning registers (`setup`) and is chained in
    # front of Lightning's once it has (the first hook after registering); Lightning restores the old
    # handlers when the stage ends, and `teardown` puts ours back.
    def _release_requeue_signal(self, trainer: Trainer) -> None:
        signum = _requeue_signal(trainer)
        release = getattr(ot.current_session(), "release_signal", None)
        if signum is None or self._released is not None or release is None:
            return
        ours = release(signum)
        if ours is not None:
            self._released = (signum, ours, signal.getsignal(signum))

    def _chain_requeue_signal(self) -> None:
        if self._released is None or threading.current_thread() is not threading.main_thread():
            return
        signum, ours, released_to = self._released
        current = signal.getsignal(signum)
        if isinstance(current, _FlushThenRequeue) and current.ours is ours:
            return  # chained already (an earlier stage hook)
        if current is released_to or not callable(current):  # Lightning installed nothing: ours again
            signal.signal(signum, ours)
        else:
            signal.signal(signum, _FlushThenRequeue(ours, current))

    def _reclaim_requeue_signal(self) -> None:
        if self._released is None or threading.current_thread() is not threading.main_thread():
            return
        signum, ours, released_to = self._released
        self._released = None
        current = signal.getsignal(signum)
        if current is released_to or (isinstance(current, _FlushThenRequeue) and current.ours is ours):
            signal.signal(signum, ours)  # Lightning restored what it found; the process goes on: ours again

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._chain_requeue_signal()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._chain_requeue_signal()

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._chain_requeue_signal()

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._chain_requeue_signal()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._spans.end_all(exception)
        self._step.end()

    def _wrap_checkpoint_saves(self, trainer: Trainer) -> None:
        # Callbacks hear `on_save_checkpoint` before the file is written and nothing after it;
        # timing `trainer.save_checkpoint` (what ModelCheckpoint calls) covers the whole save.
        original = trainer.save_checkpoint
        spans = self._spans

        @functools.wraps(original)
        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            spans.begin("checkpoint", "checkpoint/save", trainer.global_step, {"path": str(filepath)})
            try:
                result = original(filepath, *args, **kwargs)
            except BaseException as err:
                spans.end("checkpoint", err)
                raise
            spans.end("checkpoint")
            return result

        self._save_checkpoint = original
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    # -- training ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._chain_requeue_signal()
        if trainer.ckpt_path is not None:  # `fit(ckpt_path=)` restored the loops: batches go on at global_step
            self._owned.resume_at(trainer.global_step, rank=trainer.global_rank, local_rank=trainer.local_rank,
                                  world_size=trainer.world_size)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._spans.begin("train_epoch", "train/epoch", trainer.global_step, {"epoch": trainer.current_epoch})

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._spans.end("train_epoch")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self._step.begin(step)
        self._spans.begin("train_batch", "train/batch", step, {"batch_idx": batch_idx, "epoch": trainer.current_epoch})

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._spans.end("train_batch")
        self._step.end()

    # -- validation and test -----------------------------------------------------------------------
    def _eval_begin(self, stage: str, trainer: Trainer) -> None:
        attrs = {"sanity_check": True} if trainer.sanity_checking else {}
        self._spans.begin(f"{stage}_epoch", f"{stage}/epoch", trainer.global_step, attrs)

    def _eval_batch_begin(self, stage: str, trainer: Trainer, batch_idx: int, dataloader_idx: int) -> None:
        self._spans.begin(f"{stage}_batch", f"{stage}/batch", trainer.global_step,
                          {"batch_idx": batch_idx, "dataloader_idx": dataloader_idx})

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_begin("val", trainer)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._spans.end("val_epoch")

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_batch_begin("val", trainer, batch_idx, dataloader_idx)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._spans.end("val_batch")

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_begin("test", trainer)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._spans.end("test_epoch")

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_batch_begin("test", trainer, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._spans.end("test_batch")
