"""The kernel calls of attention between query chunks and key chunks: causal, within packed
documents, within a sliding window.

Which keys a query sees: query i sees key j when lo_i <= j <= i, where lo_i is the later of its
document's start (data.reset_attention_mask; 0 without documents) and i - window (model.window_size,
how far back it may look; no bound without one). `starts` [batch, seq] holds, for every position of
the whole sequence, the position its document starts at (nondecreasing along a sample); the key side
needs nothing, so a rank needs no other rank's document ids, whichever keys reach it.

No mask is built, dense or by block. Over a (query chunk, key chunk) pair, each piece of a document
is a staircase band: lo and i each grow by one a row or stay put. It is cut into rows where neither
changes how it grows, and each such run into kernel calls of three shapes over contiguous rows and
keys: FULL (every row sees every key), CAUSAL (row r sees keys 0..r: the kernels' own is_causal on a
square) and ANTI (row r sees keys r..: the window's back edge, a causal square with rows and keys
both reversed). A pair the window or the documents never reach gives no call (the ring skips it).

Where every sample of the micro-batch gives the same calls (no document boundary in the way, the
common case of long documents) they are batched calls, the same as without documents; otherwise one
call a sample and piece. So short documents cost one small kernel call each (a Python loop; on CPU
torch has no variable-length kernel, and this is exact with no masked work at all).
"""
from __future__ import annotations

import numpy as np
import torch

ALL = slice(None)
FULL, CAUSAL, ANTI = "full", "causal", "anti"
# (samples, query rows, key rows, shape): rows index the local queries, keys the key buffer.
Call = tuple[slice, slice, slice, str]
# (first row, end row, first key, end key, shape), in sequence positions
Span = tuple[int, int, int, int, str]


def plan_calls(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...], chunk: int,
               starts: torch.Tensor | None = None, window: int | None = None) -> list[Call]:
    """The calls of local query chunks (global chunk ids, in memory order) over key chunks
    (global ids, in the key buffer's order), `chunk` tokens each. starts: the documents of the
    whole sequence (CPU, [batch, seq]); None: one document a sample. window: how far back a
    query may look (None: to its document's start)."""
    if starts is None:
        return [(ALL, *call) for call in _sample_calls(query_chunks, key_chunks, chunk, None,
                                                       window)]
    starts = starts.numpy() if isinstance(starts, torch.Tensor) else np.asarray(starts)
    return _batched([_sample_calls(query_chunks, key_chunks, chunk, row, window)
                     for row in starts])


def _sample_calls(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...], chunk: int,
                  starts: np.ndarray | None, window: int | None) -> list[tuple[slice, slice, str]]:
    """One sample's calls (starts: its documents, or None), adjacent FULL calls over the same
    rows joined."""
    out: list[tuple[slice, slice, str]] = []
    for qi, q in enumerate(query_chunks):
        first = q * chunk
        pieces = [(first, first + chunk, 0)] if starts is None else [
            (first + a, first + e, int(starts[first + a]))
            for a, e in _pieces(starts[first:first + chunk])]
        for ki, k in enumerate(key_chunks):
            for a, e, start in pieces:
                for r0, r1, k0, k1, shape in band(a, e, start, k * chunk, (k + 1) * chunk,
                                                  window):
                    rows = slice(r0 - first + qi * chunk, r1 - first + qi * chunk)
                    keys = slice(k0 - k * chunk + ki * chunk, k1 - k * chunk + ki * chunk)
                    last = out[-1] if out else None
                    if (shape == FULL and last is not None and last[2] == FULL
                            and last[0] == rows and last[1].stop == keys.start):
                        out[-1] = (rows, slice(last[1].start, keys.stop), FULL)
                    else:
                        out.append((rows, keys, shape))
    return out


def band(first: int, end: int, start: int, key_first: int, key_end: int, window: int | None
         ) -> list[Span]:
    """The spans of rows [first, end) of one document (starting at `start`) over keys
    [key_first, key_end), all sequence positions. Row i sees keys lo_i..hi_i, lo_i =
    max(start, key_first, i - window), hi_i = min(i, key_end - 1): each either constant or
    growing one a row, changing only at the rows cut below."""
    low = max(start, key_first)  # lo while the window's edge is behind it
    if low >= key_end:
        return []
    reach = window if window is not None else end  # no window: i - end is before any key
    rows = (max(first, low), min(end, key_end + reach))
    if rows[0] >= rows[1]:
        return []
    slides, clipped = low + reach + 1, key_end  # lo = i - window from here; hi = key_end - 1
    cuts = sorted({rows[0], rows[1], *(c for c in (slides, clipped) if rows[0] < c < rows[1])})
    spans: list[Span] = []
    for x, y in zip(cuts, cuts[1:]):
        if x >= slides:  # lo grows with i: the window's back edge
            spans += _sliding(x, y, reach, key_end, hi_grows=y <= clipped)
        elif y <= clipped:  # lo fixed, hi = i: the keys before x in full, then the diagonal
            spans += [(x, y, low, x, FULL)] if x > low else []
            spans.append((x, y, x, y, CAUSAL))
        else:  # lo and hi fixed
            spans.append((x, y, low, key_end, FULL))
    return spans


def _sliding(x: int, y: int, window: int, key_end: int, hi_grows: bool) -> list[Span]:
    """Rows [x, y) whose lo_i = i - window: the keys each row's window reaches back to, a
    triangle, then the rest."""
    if not hi_grows:  # hi = key_end - 1: the back edge's triangle, then every key after it
        n, lo = y - x, x - window
        return [(x, y, lo, lo + n, ANTI), *([(x, y, lo + n, key_end, FULL)]
                                          if key_end > lo + n else [])]
    spans: list[Span] = []
    for a in range(x, y, window):  # a band of window + 1 keys: runs of at most `window` rows
        e = min(a + window, y)
        m, lo = e - a, a - window
        spans.append((a, e, lo, lo + m, ANTI))
        if lo + m < a:
            spans.append((a, e, lo + m, a, FULL))
        spans.append((a, e, a, e, CAUSAL))
    return spans


def _pieces(row: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each document's piece of a chunk (chunk-relative)."""
    cuts = np.flatnonzero(np.diff(row)) + 1
    edges = [0, *cuts.tolist(), len(row)]
    return list(zip(edges[:-1], edges[1:]))


def _batched(per_sample: list[list[tuple[slice, slice, str]]]) -> list[Call]:
    """Calls for the whole micro-batch where every sample makes the same ones."""
    first = per_sample[0]
    if all(calls == first for calls in per_sample):
        return [(ALL, rows, keys, shape) for rows, keys, shape in first]
    return [(slice(b, b + 1), rows, keys, shape)
            for b, calls in enumerate(per_sample) for rows, keys, shape in calls]
