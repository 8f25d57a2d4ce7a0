"""WritePages in pieces: no request is larger than 4 MiB (docs/protocol.md, "Message size
limits"), so a page travels as pieces, each starting where the one before it ended, the
next page's first piece at offset 0. This is the rule, kept per call in O(1): the call
fails (INVALID_ARGUMENT) at a piece out of order or at a page left unfinished."""
from __future__ import annotations

from kvtier_client.errors import InvalidArgument


class PieceOrder:
    """The pieces of one WritePages call; `pages` counts the pages completed."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.pages = 0
        self._index: int | None = None  # the page being filled
        self._filled = 0

    def take(self, index: int, offset: int, size: int) -> None:
        """Check a piece before its bytes are written."""
        if offset == 0:
            self._check_finished()
            self._index, self._filled = index, 0
        elif (index, offset) != (self._index, self._filled):
            where = f"page {self._index} up to byte {self._filled}" if self._index is not None else "nothing"
            raise InvalidArgument(f"page {index}: a piece at offset {offset} does not continue the piece before it "
                                  f"({where}); send each page's pieces in order, the first at offset 0")
        if offset + size > self.page_bytes:
            raise InvalidArgument(f"page {index}: {size} bytes at offset {offset} run past the page's "
                                  f"{self.page_bytes} bytes")
        self._filled = offset + size
        if self._filled == self.page_bytes:
            self.pages += 1
            self._index = None

    def end(self) -> int:
        """The call's last piece came: every page it began is whole. Returns the pages."""
        self._check_finished()
        return self.pages

    def _check_finished(self) -> None:
        if self._index is not None:
            raise InvalidArgument(f"page {self._index} got {self._filled} of its {self.page_bytes} bytes; "
                                  "send the rest in the pieces after it")
