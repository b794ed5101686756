"""The caller's output arrays for a batch, checked against its plan before anything is
read: ``Batches.fill``'s data, labels and other sources' arrays, and ``fill_parts``'
parts. A mismatch is a ShapeError (or ArgumentError) that names the array and what the
plan needs; nothing is written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .._errors import ArgumentError, ShapeError
from ._fill import Part
from ._kernels import Geometry, check_geometry_out
from ._plan import BatchPlan

__all__ = ["check_outputs", "checked_extra", "checked_parts"]


def check_outputs(
    plan: BatchPlan, rows: int, data: np.ndarray, label: np.ndarray, data_name: str,
    label_name: str,
) -> None:  # fmt: skip
    """Refuse arrays for ``rows`` rows of ``plan`` of another shape or element type.

    Raises:
        ShapeError: names the array (``data_name``, ``label_name``) and what it needs.
    """
    shape = (rows, *plan.data_shape[1:])
    if data.shape != shape or data.dtype != plan.dtype:
        raise ShapeError(
            f"{data_name} has shape {data.shape} dtype {data.dtype}; the plan needs shape "
            f"{shape} dtype {plan.dtype}"
        )
    if label.shape != (rows,) or label.dtype != plan.label_dtype:
        raise ShapeError(
            f"{label_name} has shape {label.shape} dtype {label.dtype}; the plan needs "
            f"shape ({rows},) dtype {plan.label_dtype}"
        )


def checked_extra(
    plan: BatchPlan, extra_out: Mapping[str, np.ndarray] | None
) -> list[tuple[BatchPlan, np.ndarray]]:
    """Each other source's part of ``plan`` and its array from ``extra_out``, in the
    plan's order (empty for a plan of one source).

    Raises:
        ShapeError: an array is missing, of another shape or dtype, or names no source.
    """
    if not plan.extra:
        return []
    given = dict(extra_out or {})
    outs = []
    for name, part in plan.extra:
        out = given.pop(name, None)
        if out is None:
            raise ShapeError(f"extra_out has no array for the source {name!r}")
        if out.shape != part.data_shape or out.dtype != part.dtype:
            raise ShapeError(
                f"extra_out[{name!r}] has shape {out.shape} dtype {out.dtype}; the "
                f"plan needs shape {part.data_shape} dtype {part.dtype}"
            )
        outs.append((part, out))
    if given:
        raise ShapeError(f"extra_out names {sorted(given)}, which are not sources")
    return outs


def checked_parts(
    plan: BatchPlan, parts: Sequence[tuple[np.ndarray, np.ndarray, Geometry | None]]
) -> list[Part]:
    """``fill_parts``' parts, each checked for its rows: together they hold the plan's.

    Raises:
        ArgumentError: the parts do not hold the plan's rows, or the plan has other
            sources read in lockstep.
        ArgumentTypeError, ShapeError: a part's arrays as :func:`check_outputs` and
            ``check_geometry_out`` check them.
    """
    if plan.extra:
        raise ArgumentError(
            "fill_parts: a plan with other sources read in lockstep is filled with fill"
        )
    if sum(len(label) for _, label, _ in parts) != len(plan):
        raise ArgumentError(
            f"fill_parts: the parts hold {sum(len(label) for _, label, _ in parts)} rows; "
            f"the plan has {len(plan)}"
        )
    tail, dtype, label_dtype = plan.data_shape[1:], plan.dtype, plan.label_dtype
    checked = []
    for k, part in enumerate(parts):
        data, label, geometry = part
        m = len(label)
        # (check_outputs' checks, written out: a chunk of small batches has many parts)
        if (
            data.shape != (m, *tail)
            or data.dtype != dtype
            or label.shape != (m,)
            or label.dtype != label_dtype
        ):
            check_outputs(plan, m, data, label, f"parts[{k}] data", f"parts[{k}] label array")
        if geometry is not None:
            check_geometry_out(geometry, m)
        checked.append(part if type(part) is Part else Part(data, label, geometry))
    return checked
