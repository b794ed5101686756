"""The contenders by name (:func:`make`), and the fresh process in which a contender's
first epoch runs (``python _make.py SPEC``, started by ``_contenders``).

Above ``_contenders`` and ``_dali`` (each contender's module): neither imports this one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from _contenders import (
    AsyncHost,
    BatchesLoop,
    Contender,
    Files,
    LoaderAsync,
    LoaderBlocking,
    PlainLoop,
    Recipe,
    TorchRecipe,
    close_shared_envs,
)
from _dali import DaliPipeline
from _fresh import prefault

__all__ = ["make"]


def make(
    key: str,
    files: Files,
    recipe: Recipe,
    out_shape: tuple[int, int, int],
    host: AsyncHost | None = None,
) -> Contender:
    """The plain loop ("plain"), the torch recipe ("torch"), DALI's CPU pipeline ("dali";
    "dali-roi": decoding only the crop), the Loader ("async", "blocking"; "blocking1":
    one worker; "again": the blocking form a second time, an A/A control) or Batches by
    hand ("batches") for a
    workload whose output rows are ``out_shape``; its first epochs run in a fresh
    process."""
    contender: Contender
    if key == "plain":
        contender = PlainLoop(files, recipe, out_shape)
    elif key == "torch":
        contender = TorchRecipe(files, recipe)
    elif key == "async":
        contender = LoaderAsync(files, recipe, host)
    elif key == "blocking":
        contender = LoaderBlocking(files, recipe)
    elif key == "blocking1":
        contender = LoaderBlocking(files, recipe, workers=1)
    elif key == "again":
        contender = LoaderBlocking(files, recipe, again=True)
    elif key == "batches":
        contender = BatchesLoop(files, recipe)
    elif key in ("dali", "dali-roi"):
        contender = DaliPipeline(files, recipe, roi=key == "dali-roi")
    else:
        raise ValueError(f"no contender {key!r}")
    contender.fresh_first = True
    contender.out_shape = out_shape
    return contender


def _child(argv: list[str]) -> int:
    """``python _make.py SPEC``: one first epoch (``_contenders._first_in_fresh_process``);
    prints ``{"images": ..., "seconds": ...}``."""
    spec = json.loads(argv[0])
    files = Files(**{k: Path(v) for k, v in spec["files"].items()})
    recipe = Recipe.from_doc(spec["recipe"])
    # numpy.random (imported on first use, some milliseconds) before the clock for
    # every contender: the plain loop makes its generator before it, and a training
    # script has it imported (torch imports it)
    import numpy.random  # noqa: F401

    if spec["key"] == "torch":
        import torch.utils.data  # noqa: F401  (imported before the clock, as a script does)
    if spec["key"].startswith("dali"):
        import nvidia.dali  # noqa: F401
    # (the async form's event loop runs in this thread, made before the clock: as a
    # training script's asyncio.run(main()); in a portal's thread its first epochs read
    # 0.91x the direct form's in one run of 20 alternating processes, level in another)
    prefault(spec.get("prefault", 0))  # after the imports, before the clock
    try:
        contender = make(spec["key"], files, recipe, tuple(spec["out_shape"]))
        sample = contender.first_here(spec["batch"] is not None)
        contender.close()
    finally:
        close_shared_envs()
    if spec["batch"] is not None:
        np.save(spec["batch"], sample.first_batch)
    print(json.dumps({"images": sample.images, "seconds": sample.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
