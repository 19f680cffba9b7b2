#!/usr/bin/env bash
# lm-evaluation-harness (pinned, installed on demand into its own venv, not a test dependency)
# against `llmc run` on loopback, with a local multiple-choice task (20 questions from
# data/heldout.txt: which line follows; 80 loglikelihood requests), since the Hugging Face Hub's task
# datasets are out of reach here.   bash benchmarks/lm_eval_local.sh ARTIFACT [PORT]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
artifact=$(cd "$1" && pwd); port=${2:-8765}; venv=${LM_EVAL_VENV:-$repo/.lm-eval-venv}
[ -x "$venv/bin/lm_eval" ] || { python3 -m venv --system-site-packages "$venv" \
  && "$venv/bin/pip" install -q "lm-eval[api]==0.4.13" "torch==$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"; }
python3 -m llmc.cli run "$artifact" --port "$port" --device cpu > /tmp/lm_eval_server.log 2>&1 &
server=$!; trap 'kill $server' EXIT
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
cd "$repo" && HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$venv/bin/lm_eval" --model local-completions \
  --tasks llmc_heldout_mc --include_path benchmarks/lm_eval_task \
  --model_args "model=$(basename "$artifact"),base_url=http://127.0.0.1:$port/v1/completions,tokenizer=$artifact/tokenizer,tokenized_requests=True,num_concurrent=4"
