"""Forward graphs: a model forward recorded once and replayed without Python.

At decode batch sizes a step's arithmetic is small and the Python that drives it (module
calls, views, kernel launches) is a large share of the step. A platform that can record
the kernels a forward runs and replay them, bound to fixed input and output buffers (CUDA
graphs on GPUs, a table of native calls on CPUs), offers a :class:`ForwardGraphCapturer`
through ``Platform.forward_graph_capturer()``. The model runner captures decode-only
forwards with it, one graph per batch size, over persistent input buffers it refills
before every replay.

A captured forward may only do what the platform can record: every computation must be
one of its kernels, and no Python decision may depend on tensor values (they would be
frozen at capture). A capturer raises :class:`GraphCaptureError` for a forward that breaks
this, and the runner keeps running that forward eagerly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class GraphCaptureError(RuntimeError):
    """The forward does something the platform cannot record (it then runs eagerly)."""


class ForwardGraph(ABC):
    """One captured forward, bound to the buffers it read and wrote at capture."""

    @abstractmethod
    def replay(self) -> "torch.Tensor":
        """Run the forward on the current contents of its input buffers; returns its
        output (a tensor the graph owns and overwrites at the next replay of any graph
        of the same capturer)."""


class ForwardGraphCapturer(ABC):
    """Records forwards into graphs; the graphs of one capturer may share memory, so they
    must be replayed one at a time."""

    #: Whether a capture records the tensor-parallel collectives a forward calls, so a
    #: replay meets the other ranks in them (the CPU plugin's shared-memory all-reduce is
    #: one of its replayed kernels). Without it tensor-parallel ranks run eagerly; a
    #: collective a capture cannot record must raise GraphCaptureError, never run.
    records_collectives: bool = False

    @abstractmethod
    def capture(self, forward: Callable[[], "torch.Tensor"]) -> ForwardGraph:
        """Record ``forward()`` (which may not actually compute anything while recorded)
        into a graph; raises GraphCaptureError when it cannot be recorded."""
