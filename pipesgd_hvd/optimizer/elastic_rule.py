"""Horovod elastic: what the pipeline keeps and what it drops when workers come or go.

``hvd.elastic.run`` restarts the training function whenever the world changes: on
``HorovodInternalError`` (a worker was lost) it calls ``state.restore()`` (back to the last
``state.commit()``), on ``HostsUpdatedInterrupt`` (hosts added or removed, raised by
``commit()``/``check_host_updates()`` on every rank at the same point) it keeps the state as it is;
then it shuts Horovod down, initializes it again, and calls ``state.sync()`` on every rank of the
new world, new workers included. With the pipelined optimizer in ``hvd.elastic.TorchState``:

- ``commit()`` saves the optimizer's ``state_dict()``, which waits for the steps in flight and
  holds their averaged gradients (the same bytes on every rank), the wrapped optimizer's state,
  the step count and the error-feedback residuals.
- A world change drops every reduction not yet waited for, on every rank: its collectives belong
  to the old world and are never waited on (some ranks may have finished one that others had
  not, so applying any would make replicas differ). After a lost worker this loses nothing
  committed: ``restore()`` goes back to the commit, in-flight gradient included. After
  ``HostsUpdatedInterrupt`` raised by ``commit()`` nothing is in flight unwaited (the commit just
  waited); raised by a bare ``check_host_updates()`` the steps still in flight are lost (at most
  ``width - 1``), the same ones on every rank.
- ``sync()`` rebuilds the pipeline for the new world (its size and ranks; the cross-rank check
  of settings and tensors runs again) and every rank continues from rank 0's state: weights
  (Horovod's model handler), the wrapped optimizer's state, the averaged in-flight gradients and
  the step count, so new workers apply the same pending gradient and replicas stay bitwise equal.
- Error-feedback residuals start afresh (zero) on every rank: a residual is one rank's
  quantization error for its chunk of a world of a given size, which means nothing once the
  ranks and chunks are renumbered. At most one step's quantization error per rank is lost.

This module is framework-free; ``torch/elastic_state.py`` plugs it into ``TorchState``.
"""
from __future__ import annotations

import os
from typing import Any, Dict


def is_elastic_job() -> bool:
    """Whether this process was started by an elastic ``horovodrun`` (``--min-np``/``--max-np``/
    ``--host-discovery-script``), which sets ``HOROVOD_ELASTIC=1`` for its workers."""
    return os.environ.get("HOROVOD_ELASTIC", "0").strip() not in ("", "0")


def state_for_new_world(held: Dict[str, Any], fresh_codec_state: Dict[str, Any]) -> Dict[str, Any]:
    """The engine state (as ``PipelineEngine.abandon()`` returned it on rank 0) that every rank of
    a new world loads: the averaged in-flight gradients, the step count and the byte counters as
    they are, the codec state replaced by a fresh codec's (residuals are per rank and per world)."""
    return {**held, "codec": fresh_codec_state}
