"""The trace format (``docs/trace_format.md``) in one namespace, for its readers and writers (``fmt.X``).

It is three modules, by concern: :mod:`.framing` (preamble, record kinds, framed records and their CRCs,
bounded zstd, varints, JSON and bundles), :mod:`.codecs` (integer streams and columns, float bit streams, the
logit quantisation) and :mod:`.sequence` (the sequence record); :mod:`.records` holds the batch, steps,
batch-end and end records. Helpers private to a module are imported from that module.
"""
from .codecs import *  # noqa: F401,F403
from .framing import *  # noqa: F401,F403
from .sequence import *  # noqa: F401,F403
