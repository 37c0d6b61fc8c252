#!/usr/bin/env bash
# `transformer-jax serve` against `transformers serve --continuous-batching` on one HF
# checkpoint, the same client load on both (`transformer-jax bench serve --url URL
# --http-prompts text`), every stream checked complete.
#
#   bash benchmarks/serve_vs_transformers.sh [REPO]   REPO: the checkout (default: this one);
#   its .venv needs the test extras (transformers, torch: the README's test command)
#
# Environment (all optional):
#   WORK=/tmp/hfserve_cmp   checkpoint, compilation cache, logs, result JSONs
#   SHAPE=tiny              the model: tiny (tiny.toml's shape: d 128, 4 layers, vocab 2048) or
#                           25m (decode_25m's: d 512, 8 layers, vocab 8192); context 1024 both
#   LOADS="64 256"          which loads: 64 (64 streams at once, inputs 16-256, outputs 64-256)
#                           and 256 (256 requests at once, inputs 16-512, outputs 16-256)
#   SLOTS=64                our server's --slots
#   HF_CB_FLAGS="--cb-max-memory-percent 0.05"   transformers' --cb-* flags: 5% of the
#                           host memory for its KV cache (~1.1 GiB here, what ours takes for
#                           25m; the default 0.9 would take ~19 GiB of this shared host)
#   ORDER="ours theirs"     which servers, in this order
#
# Run time on the 2-core host under load 3-6 (other jobs): 4.5 min for the defaults with a
# warm compilation cache ($WORK/jax-cache; an empty one adds about 70 s for tiny, 4 min for
# 25m). Results: $WORK/results-$SHAPE/{ours,theirs}-{64,256}.json (bench serve --json) and .out.
#
# The checkpoint (made once, in $WORK/ckpt-$SHAPE): a random-weight LlamaForCausalLM
# (save_pretrained, float32, seed 0) with no eos anywhere (config, generation_config and
# tokenizer name none, so neither server can stop a stream early; transformers' batching then
# disables eos, ours has none to stop at), and a word-level tokenizer of words w0..w{V-1}
# (whitespace pre-tokenizer, no special tokens) whose ids round-trip through text, so the
# client counts each chunk's tokens exactly by encoding its text; the last chunk's usage must
# agree, and every stream must have exactly its max_tokens.
set -euo pipefail
REPO=$(cd "${1:-$(dirname "$0")/..}" && pwd)
PY=${PY:-$REPO/.venv/bin/python}
HF=${HF:-$REPO/.venv/bin/transformers}
WORK=${WORK:-/tmp/hfserve_cmp}
SHAPE=${SHAPE:-tiny}
LOADS=${LOADS:-64 256}
SLOTS=${SLOTS:-64}
HF_CB_FLAGS=${HF_CB_FLAGS:---cb-max-memory-percent 0.05}
ORDER=${ORDER:-ours theirs}
PORT=${PORT:-18431}
CKPT=$WORK/ckpt-$SHAPE
OUT=$WORK/results-$SHAPE
export PYTHONPATH=$REPO JAX_PLATFORMS=cpu
mkdir -p "$WORK" "$OUT"
T0=$(date +%s)
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s, load $(cut -d' ' -f1-3 /proc/loadavg)] $*"; }

load_args() {  # the bench serve arguments of load $1
  case $1 in
    64) echo "--requests 64 --input-len 16,256 --output-len 64,256 --output-multiple 16";;
    256) echo "--requests 256 --input-len 16,512 --output-len 16,256 --output-multiple 16";;
    warm) echo "--requests 64 --input-len 16,64 --output-len 16,16 --output-multiple 16 --seed 7";;
    *) echo "unknown load $1" >&2; exit 2;;
  esac
}

for load in $LOADS; do load_args "$load" > /dev/null; done  # an unknown load: exit 2 now

# 1. The checkpoint -------------------------------------------------------------------------
if [ ! -f "$CKPT/tokenizer.json" ]; then
  log "making $CKPT"
  "$PY" - "$CKPT" "$SHAPE" <<'EOF'
import json, sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import models, pre_tokenizers

out, shape = Path(sys.argv[1]), sys.argv[2]
v, d, layers, heads, kv, ff = {"25m": (8192, 512, 8, 8, 4, 1280),
                               "tiny": (2048, 128, 4, 4, 2, 384)}[shape]
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=v, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
    num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    pad_token_id=None)
model = transformers.LlamaForCausalLM(config).to(torch.float32)
model.generation_config = transformers.GenerationConfig(bos_token_id=None, eos_token_id=None,
                                                        pad_token_id=None)
model.save_pretrained(out, safe_serialization=True)
words = {f"w{i}": i for i in range(v)}
tok = tokenizers.Tokenizer(models.WordLevel(words, unk_token="w0"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps(
    {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024,
     "clean_up_tokenization_spaces": False}))
print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
EOF
fi

SERVER=
stop_server() {
  if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER"; wait "$SERVER" 2>/dev/null || true
  fi
  SERVER=
}
trap stop_server EXIT

wait_ready() {  # $1: a URL that answers 200 once the server serves; $2: its log
  local end=$(( $(date +%s) + 900 ))
  until curl -sf -m 5 "$1" >/dev/null 2>&1; do
    if ! kill -0 "$SERVER" 2>/dev/null; then echo "the server died:"; tail -20 "$2"; exit 1; fi
    if [ "$(date +%s)" -gt "$end" ]; then echo "not ready in 900 s"; tail -20 "$2"; exit 1; fi
    sleep 2
  done
}

run_loads() {  # $1: ours|theirs
  local url=http://127.0.0.1:$PORT
  log "$1: warm-up load"
  "$PY" -m transformer_jax.bench serve --checkpoint "$CKPT" --url "$url" --http-prompts text \
    $(load_args warm) --json "$OUT/$1-warm.json" > "$OUT/$1-warm.out" 2>&1 \
    || { cat "$OUT/$1-warm.out"; exit 1; }
  for load in $LOADS; do
    log "$1: load $load"
    echo "load_avg_before $(cut -d' ' -f1-3 /proc/loadavg)" > "$OUT/$1-$load.out"
    /usr/bin/time -f "client cpu %U user %S sys, wall %e s" \
      "$PY" -m transformer_jax.bench serve --checkpoint "$CKPT" --url "$url" \
      --http-prompts text $(load_args "$load") --json "$OUT/$1-$load.json" \
      >> "$OUT/$1-$load.out" 2>&1 || { cat "$OUT/$1-$load.out"; exit 1; }
    grep -E "^http|client cpu" "$OUT/$1-$load.out" | sed "s/^/  /"
  done
}

server_cpu() {  # user+sys CPU seconds of process $1 and its children so far
  local total=0 p
  for p in $1 $(pgrep -P "$1" || true); do
    total=$(( total + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0) ))
  done
  echo "$(( total / $(getconf CLK_TCK) ))"
}

for side in $ORDER; do
  if [ "$side" = ours ]; then
    log "ours: transformer-jax serve --slots $SLOTS"
    "$PY" -m transformer_jax.serve --checkpoint "$CKPT" --port "$PORT" --slots "$SLOTS" \
      --compilation-cache "$WORK/jax-cache" --log-level warning > "$OUT/ours.log" 2>&1 &
    SERVER=$!
    wait_ready "http://127.0.0.1:$PORT/health" "$OUT/ours.log"
  else
    log "theirs: transformers serve --continuous-batching $HF_CB_FLAGS"
    "$HF" serve "$CKPT" --continuous-batching --device cpu --dtype float32 $HF_CB_FLAGS \
      --host 127.0.0.1 --port "$PORT" --log-level warning > "$OUT/theirs.log" 2>&1 &
    SERVER=$!
    wait_ready "http://127.0.0.1:$PORT/v1/models" "$OUT/theirs.log"
  fi
  log "$side: ready"
  rm -f "$OUT/$side"-*.json
  before=$(server_cpu "$SERVER")
  run_loads "$side"
  echo "  server CPU during the loads (warm-up included): $(( $(server_cpu "$SERVER") - before )) s"
  stop_server
  log "$side: stopped"
done

# Figures ------------------------------------------------------------------------------------
"$PY" - "$OUT" "$LOADS" <<'EOF'
import json, sys
from pathlib import Path

work, loads = Path(sys.argv[1]), sys.argv[2].split()
def get(side, load):
    p = work / f"{side}-{load}.json"
    return json.loads(p.read_text()) if p.exists() else None
print(f"\n{'load':>5} {'server':<7} {'tok/s':>8} {'streams':>8} {'TTFT med':>9} "
      f"{'TPOT med':>9} {'E2E p99':>8} {'load avg':>16}")
for load in loads:
    rows = {s: get(s, load) for s in ("ours", "theirs")}
    for s, r in rows.items():
        if r is None:
            continue
        h = r["modes"]["http"]
        print(f"{load:>5} {s:<7} {h['output_token_throughput']:8.1f} "
              f"{h['streams_completed']:>4}/{r['args']['requests']:<3} "
              f"{h['ttft_s']['median'] * 1e3:7.0f}ms {h['tpot_s']['median'] * 1e3:7.1f}ms "
              f"{h['e2e_s']['p99']:7.1f}s {' '.join(f'{x:.1f}' for x in r['load_avg']):>16}")
    if all(rows.values()):
        ratio = (rows["ours"]["modes"]["http"]["output_token_throughput"]
                 / rows["theirs"]["modes"]["http"]["output_token_throughput"])
        print(f"{load:>5} ours / theirs: {ratio:.2f}x output tok/s "
              f"({'at least' if ratio >= 2 else 'below'} 2x)")
EOF
log "done"
