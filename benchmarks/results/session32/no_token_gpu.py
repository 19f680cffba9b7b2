"""Session 32: constraints that leave no token allowed, on CUDA (the GPU machine lacks jsonschema, which the
test module imports): allowed ids min_tokens bans, and (if xgrammar is installed) a complete regex while
min_tokens bans eos, beside a free request; prints the outputs and whether every block came back."""
import sys

from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

artifact = sys.argv[1]
with LLM(artifact, device="cuda", max_num_seqs=8, disable_log_stats=True) as llm:
    eos = llm.engine.eos_token_ids[0]
    cases = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, min_tokens=3, allowed_token_ids=[eos]),
             SamplingParams(temperature=0, max_tokens=12, min_tokens=3, allowed_token_ids=[eos], logprobs=2)]
    try:
        from llmc.runtime.structured_output import GuidedDecodingParams
        import xgrammar  # noqa: F401
        cases.append(SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                                    guided_decoding=GuidedDecodingParams(regex="(yes|no)")))
    except ImportError:
        print("no xgrammar here: the regex case is skipped")
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(["no no no no no"] * (len(cases) + 1), [*cases, free])
    for o in outputs:
        c = o.outputs[0]
        print(repr(c.text), c.token_ids, c.finish_reason)
    alone = llm.generate(["no no no no no"], free)[0].outputs[0].token_ids
    pool = llm.engine.scheduler.block_pool
    print("free row unchanged:", outputs[-1].outputs[0].token_ids == alone,
          "| blocks free:", pool.num_free_blocks == pool.num_blocks)
