"""Session 47, call 4: benchmarks/mla_prefill.py with mla_attention.EXPAND_MAX_SCORES set to 2 ** argv[1] (since then the
CUDA route reads CUDA_EXPAND_MAX_SCORES instead) (on CUDA the
memory-efficient kernel materializes no scores, so the query blocks it makes only add calls and merges).

    python -P scores_probe.py 28 --out X.json --lengths 2048,8192 ...   (2**28, the default)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import llmc.kernels.mla_attention as mla_attention  # noqa: E402
import mla_prefill  # noqa: E402

mla_attention.EXPAND_MAX_SCORES = 2 ** int(sys.argv[1])
mla_prefill.main(sys.argv[2:])
