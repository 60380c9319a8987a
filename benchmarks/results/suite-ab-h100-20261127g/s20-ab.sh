# x1, carry .device/base .device/s20-ab.sh. Issue 38 candidates prepared in session 19, one warm machine, same run:
# CUDA tests of the commit kernels; then bench_md engine rows: the default, the fused integrator, the whole Verlet list
# (one run), then candidate.py linear-map-into and commit-kernels (each its own run), then the default again.
set -o pipefail
T0=$(date +%s); left() { echo $(( ${LIMIT:-575} - ($(date +%s) - T0) )); }
L=$OUT/log.txt
source .device/base/env.sh > $L 2>&1
J=/tmp/res; mkdir -p $J
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
echo "== commit kernels' CUDA tests ($(left) s left)" | tee -a $L
timeout 120 python3 -m pytest -m cuda -q -p no:cacheprovider tests/md/test_commit_kernels.py 2>&1 | tail -3 | tee -a $L
B="benchmarks/bench_md.py --systems 5k --models ${MODELS:-bundled-mace,mace-mp-medium} --dtypes float32 --ensembles nvt --md-steps 200 --md-warmup 20 --no-floor"
echo "== default, fused integrator, whole Verlet list ($(left) s left)" | tee -a $L
OUT=$J timeout 200 python3 $B --backends cgforge-engine,cgforge-engine-fused,cgforge-engine-verlet >> $L 2>&1
for c in linear-map-into commit-kernels; do
  [ "$(left)" -gt 80 ] || break
  echo "== candidate $c ($(left) s left)" | tee -a $L
  OUT=$J timeout 90 python3 benchmarks/investigations/candidate.py $c $B --backends cgforge-engine 2>&1 | sed "s/^/$c /" >> $L
done
if [ "$(left)" -gt 70 ]; then echo "== default again ($(left) s left)" | tee -a $L
  OUT=$J timeout $(( $(left) - 10 )) python3 $B --backends cgforge-engine >> $L 2>&1; fi
tar -czf $OUT/res.tgz -C $J .
echo "== table ($(left) s left)"; grep -E "^([a-z-]+ )?5k " $L | cut -c1-140
