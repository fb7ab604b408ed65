# One device call: the peer benchmark (benchmarks/peers.py): cuteaot MoeLayer vs humming-kernels vs
# torch._grouped_mm, one process. Carry generated/moe-models and .whl (holding
# humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl). Extra arguments go to peers.py
# (e.g. --models all, --m 1,64). COMMIT=<sha> records the commit when the tree has no .git.
# Writes $OUT/peers-<date>.json, $OUT/peers.txt (log + markdown table) and $OUT/humming-deps.txt.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
# humming's Requires-Dist (and the modules it imports) that this image lacks: installed with --no-deps
python3 - > $OUT/humming-deps.txt 2>&1 <<'EOF'
import importlib.util
mods = ["triton", "numpy", "safetensors", "jinja2", "cuda.bindings", "tqdm", "tabulate", "filelock", "packaging"]
print("missing:", [m for m in mods if importlib.util.find_spec(m) is None] or "none")
try:
    import humming
    print("humming", humming.__version__, "from", humming.__file__)
except Exception as exc:
    print("humming not importable:", type(exc).__name__, exc)
EOF
cat $OUT/humming-deps.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout ${PEERS_TIMEOUT:-540} python3 -m benchmarks.peers --json $OUT/peers-$(date +%F).json \
  ${COMMIT:+--commit $COMMIT} "$@" > $OUT/peers.txt 2>&1; echo "peers rc=$?"
grep -E "^FAILED" $OUT/peers.txt | head -20
sed -n '/^| model/,$p' $OUT/peers.txt
