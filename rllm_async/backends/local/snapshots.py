"""The sampler's weight versions: the newest, plus older ones kept alive while someone pins them."""

from __future__ import annotations

import threading
from collections import Counter

from rllm_async.backends.local.transformers_model import Decoder


class WeightStore:
    """Published weight snapshots by policy version, reference-counted by `acquire`/`release`.

    A snapshot is freed as soon as it is neither the newest nor acquired by anyone, so only the
    few versions still pinned by running episodes stay in memory.
    """

    def __init__(self, version: int, model: Decoder) -> None:
        self._lock = threading.Lock()
        self._models: dict[int, Decoder] = {version: model}
        self._refs: Counter[int] = Counter()
        self._latest = version

    @property
    def latest(self) -> int:
        return self._latest

    def versions(self) -> list[int]:
        """The versions whose weights are in memory."""
        with self._lock:
            return sorted(self._models)

    def publish(self, version: int, model: Decoder) -> None:
        """Make `model` the newest weights, tagged `version`."""
        with self._lock:
            old, self._latest = self._latest, version
            self._models[version] = model
            if old != version:
                self._drop_if_unused(old)

    def acquire(self) -> int:
        """Pin the newest version until `release`."""
        with self._lock:
            self._refs[self._latest] += 1
            return self._latest

    def release(self, version: int) -> None:
        with self._lock:
            if self._refs[version] <= 0:
                raise ValueError(f"release({version}) without a matching acquire()")
            self._refs[version] -= 1
            self._drop_if_unused(version)

    def get(self, version: int | None) -> tuple[int, Decoder]:
        """The weights of `version` (None: the newest) and their version."""
        with self._lock:
            v = self._latest if version is None else version
            if v not in self._models:
                raise ValueError(
                    f"policy version {v} is not in memory (have {sorted(self._models)}): "
                    "acquire() a version before generating with it"
                )
            return v, self._models[v]

    def _drop_if_unused(self, version: int) -> None:
        if version != self._latest and self._refs[version] <= 0:
            self._refs.pop(version, None)
            self._models.pop(version, None)
