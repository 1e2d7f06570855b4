"""What the prefix cache's storage tiers share: they never raise on a storage fault, they count it (and say so in
the log once per kind of fault)."""

from __future__ import annotations

import logging
import threading
from typing import Iterable


class Counted:
    """Named counters under a (re-entrant) lock, and warnings logged once per kind."""

    def __init__(self, names: Iterable[str], log: logging.Logger):
        self.counters: dict[str, int] = dict.fromkeys(names, 0)
        self._mu = threading.RLock()
        self._logged: set = set()
        self._log = log

    def _count(self, name: str, n: int = 1) -> None:
        with self._mu:
            self.counters[name] += n

    def _log_once(self, what, msg: str, *args) -> None:
        if what not in self._logged:
            self._logged.add(what)
            self._log.warning(msg, *args)
