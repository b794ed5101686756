"""Device work for a filled slot: the host→device push on the slot's stream, the
device transform, and the events that say when the slot's buffers are free again.

With the device transform, the host does Caffe's crop and mirror only, into
uint8 (the staging transform); the batch crosses to the device as uint8 (4×
less traffic than float32) and the host's kernel finishes it there
(``_io/_kernels.apply`` with ``cropped=True``: the same function, so the same
bits), over the whole batch in a constant number of launches (the mean's per-row
crops gathered in one indexing kernel), never one launch per row.

Invariants (the stream discipline, docs/design.md):

* a slot's work is issued with the slot's stream current and the backend's
  device current, so nothing of it lands on another stream or device;
* it starts with a wait for the slot's ``released`` event (the consumer's work
  on the slot's previous batch), and the timing event is recorded after that
  wait, so ``copy_time`` is the copy and transform alone;
* once anything is queued on a slot's stream, the slot's event covers it, so
  its buffers are not reused (or released) while the device reads them.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._backends import COMPLETED, Backend, Event, Stream, all_of
from .._errors import DataError, ShapeError
from .._io._batches import BatchPlan
from .._io._kernels import Geometry, apply
from .._io._transform import Transform
from ._ring import Slot

__all__ = ["DeviceWork"]


class DeviceWork:
    """Issues a filled slot's device work (nothing without a device).

    ``on_device``: the transform's mean/scale/float conversion run on the
    device; the host fills with the transform's host half
    (:meth:`Transform.host_half`, the Batches' ``split_transform``).
    """

    def __init__(self, backend: Backend, transform: Transform, on_device: bool) -> None:
        self._backend = backend
        self._transform = transform
        self.on_device = on_device
        self._lock = threading.Lock()
        self._means: dict[tuple[int, ...], Any] = {}  # record shape -> device mean (or None)

    def warm_up(self) -> None:
        """Run the device transform on a dummy batch in the calling thread (the
        loader's open), with a mean of the transform's kind (a full mean is
        gathered, a column broadcast): CuPy compiles those kernels here, once,
        rather than in every filler thread at its first batch."""
        if not self.on_device:
            return
        backend = self._backend
        xp = backend.xp
        t = self._transform
        c = 1 if t.force_gray else 3
        side = t.crop_size or 2
        stream = backend.default_stream()
        with backend.using(stream):
            src = xp.zeros((2, c, side, side), np.uint8)
            out = xp.empty(
                (2, c, side, side) if t.layout == "NCHW" else (2, side, side, c), np.float32
            )
            mean = None
            if t.mean_file:
                mean = xp.zeros((c, side, side), np.float32)
            elif t.mean_value:
                mean = xp.zeros((c, 1, 1), np.float32)
            spec = t.kernel_spec((c, side, side), mean=mean)
            zeros = np.zeros(2, np.intp)
            geometry = Geometry(zeros, zeros, np.array([False, True]))
            apply(xp, src, out, geometry, spec, cropped=True)
        stream.synchronize()

    def out_shape(self, plan: BatchPlan) -> tuple[int, ...] | None:
        """The device transform's output shape for ``plan`` (None without one)."""
        if not self.on_device:
            return None
        n, c, h, w = plan.data_shape
        return (n, c, h, w) if self._transform.layout == "NCHW" else (n, h, w, c)

    def issue(self, slot: Slot, plan: BatchPlan, path: object) -> None:
        """Queue the slot's push (and device transform) on its stream; record its events.

        Raises:
            DataError: the transform's mean does not fit the records (naming
                the batch's first record and ``path``), as on the CPU path.
        """
        backend = self._backend
        if not backend.has_device:
            slot.event = COMPLETED
            slot.started = None
            return
        assert slot.host is not None and slot.label is not None and slot.stream is not None
        stream = slot.stream
        # Everything that can fail before work is queued happens first ...
        mean = self._mean(plan, path, stream) if self.on_device else None
        with backend.using(stream):
            # the consumer's work on the slot's last batch first: nothing below
            # writes the slot's device memory before it
            backend.stream_wait(stream, slot.released)
            device_arrays = None
            if self.on_device:
                # zero-filled on first use only, on this stream, before any push
                assert slot.staged is not None and slot.out is not None
                device_arrays = (slot.staged.mutable_gpu_data(), slot.out.mutable_gpu_data())
            slot.started = backend.record_event(stream, timing=True)
            try:
                slot.label.data.start_gpu_push(stream)
                for blob in slot.extra.values():
                    blob.data.start_gpu_push(stream)
                if device_arrays is not None:
                    self._launch_transform(slot, plan, mean, *device_arrays)
                else:
                    slot.host.data.start_gpu_push(stream)
            finally:
                # ... and once anything is queued, the slot's event covers it.
                slot.event = backend.record_event(stream, timing=True)

    def release(self, stream: Stream | None, slot: Slot | None = None) -> Event:
        """An event that completes after the work queued so far on the consumer's
        ``stream`` (the Loader's named one, or the one current where the batch was
        delivered), on the calling thread's current stream (the thread letting the
        batch go) and, with ``slot``, on the streams DLPack consumers named when
        they took the batch's device memory (``__dlpack__(stream=...)``): the
        consumer's work on the batch it lets go now. The slot's next device work
        waits for it."""
        backend = self._backend
        if not backend.has_device:
            return COMPLETED
        streams = [] if stream is None else [stream]
        current = backend.current_stream()
        if not any(s.same(current) for s in streams):
            streams.append(current)
        if slot is not None:
            for blob in slot.device_blobs():
                for other in blob.take_release_streams():
                    if not any(s.same(other) for s in streams):
                        streams.append(other)
        return all_of([backend.record_event(s) for s in streams])

    def elapsed(self, slot: Slot) -> float:
        """Seconds the slot's last device work took (0 without timing events)."""
        if slot.started is not None and slot.event.query():
            return self._backend.elapsed(slot.started, slot.event)
        return 0.0

    def _launch_transform(self, slot: Slot, plan: BatchPlan, mean: Any, u8: Any, out: Any) -> None:
        """Queue on the slot's stream: the host's uint8 batch copied into ``u8`` (the
        staged blob's device array), then the kernel writing ``out`` (the output blob's)."""
        backend = self._backend
        xp = backend.xp
        t = self._transform
        assert slot.host is not None
        geometry = slot.geometry  # the host fill's, read by the kernel until slot.event
        assert geometry is not None and len(geometry) == len(plan)
        # The uint8 batch is copied into the device-only staged blob, not pushed
        # through the host blob's SyncedMemory (whose pending push would make the
        # host blob's accessors wait for the copy); the kernel runs after the copy
        # in this stream's order (launch()).
        backend.copy_to_device(u8, slot.host.cpu_data(), slot.stream)
        spec = t.kernel_spec(plan.record_shape, mean=mean)  # the device's copy of the mean

        def kernel() -> None:  # the host's kernel, over the device's arrays
            apply(xp, u8, out, geometry, spec, cropped=True)

        backend.launch(kernel, slot.stream)

    def _mean(self, plan: BatchPlan, path: object, stream: Stream) -> Any:
        """The transform's mean on the device for the plan's record shape (cached),
        uploaded on ``stream`` under the backend's device."""
        key = plan.record_shape
        with self._lock:
            if key in self._means:
                return self._means[key]
        try:
            mean = self._transform.mean_array(key)
        except ShapeError as exc:
            raise DataError(str(exc), path=path, key=plan.keys[0]) from exc
        device = None
        if mean is not None:
            with self._backend.using(stream):
                device = self._backend.xp.asarray(mean)
            stream.synchronize()  # landed before any slot's stream reads it
        with self._lock:
            return self._means.setdefault(key, device)
