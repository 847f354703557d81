"""A ``torch.distributed.Store`` that counts each call by name and hands it
on: what a test of the node watch or the counted rounds reads to say how
many requests a node made of the job's store."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist


class Counted(dist.Store):
    """Counts each call on ``inner`` by name in ``counts``."""

    def __init__(self, inner: Any, counts: Counter[str]) -> None:
        super().__init__()
        self.inner, self.counts = inner, counts

    def _count(self, name: str) -> None:
        self.counts[name] += 1

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count("multi_set")
        self.inner.multi_set(keys, values)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._count("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())
