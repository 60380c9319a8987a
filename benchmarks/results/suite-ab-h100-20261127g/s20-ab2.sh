# x2 (warm after s20-suite), carry .device/base .device/s20-ab.sh .device/s20-compile.sh .device/s20-ab2.sh:
# issue 38's A/B on GPU 0 (cores 0-15) beside MACE-MP-medium / NequIP compilation in two processes on GPU 1 (16-31).
mkdir -p $OUT/ab $OUT/compile
OUT=$OUT/ab CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=16 taskset -c 0-15 bash .device/s20-ab.sh > $OUT/ab/stdout.txt 2>&1 &
OUT=$OUT/compile CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=16 OMP_NUM_THREADS=16 taskset -c 16-31 bash .device/s20-compile.sh > $OUT/compile/stdout.txt 2>&1 &
wait
cat $OUT/compile/stdout.txt; cat $OUT/ab/stdout.txt
