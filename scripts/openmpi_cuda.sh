#!/usr/bin/env bash
# Builds a CUDA-aware Open MPI 4.1 (for `-pk kokkos gpu/aware on` on several GPUs) from a source tarball and packs
# it as PREFIX.tar.xz. Made for a GPU machine whose MPI is not CUDA-aware (the lent two-H100 machines' Open MPI
# 4.1.6): LAMMPS linked with that MPI keeps its library name (libmpi.so.40, the same ABI), so putting this build
# first on PATH and LD_LIBRARY_PATH at run time is enough; nothing needs rebuilding.
#
#   bash scripts/openmpi_cuda.sh SOURCE.tar.xz [PREFIX]       # PREFIX default /tmp/ompi-cuda
#
# SOURCE: an Open MPI 4.1.x release tarball (open-mpi.org, or Debian's `apt-get source --download-only openmpi`,
# whose openmpi_4.1.4.orig.tar.xz is the release). Needs cuda.h (CUDA_HOME, default /usr/local/cuda), not a GPU:
# Open MPI opens libcuda at run time. Unpack the result at the same PREFIX on the GPU machine
# (`tar -xJf ompi-cuda.tar.xz -C /tmp`), or set OPAL_PREFIX to where it lies. Check it with
# `ompi_info --parsable --all | grep built_with_cuda_support` (true). With CUDA support Open MPI picks its
# smcuda transport between ranks of one node (CUDA IPC: device to device).
# Took 6 min on 2 cores; the packed build is 2.7 MB.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash scripts/openmpi_cuda.sh SOURCE.tar.xz [PREFIX]" >&2; exit 2; }
source_tarball=$(realpath "$1")
prefix=${2:-/tmp/ompi-cuda}
cuda=${CUDA_HOME:-/usr/local/cuda}
[ -f "$cuda/include/cuda.h" ] || { echo "no $cuda/include/cuda.h (set CUDA_HOME)" >&2; exit 1; }
work=$(mktemp -d)
tar -xf "$source_tarball" -C "$work"
cd "$work"/openmpi-*
# no Fortran, no OpenSHMEM, no fabrics the GPU machines lack; hwloc, libevent and PMIx from the tarball
./configure --prefix="$prefix" --with-cuda="$cuda" --with-hwloc=internal --with-libevent=internal \
    --with-pmix=internal --disable-mpi-fortran --disable-oshmem --without-ucx --without-verbs --without-ofi \
    --disable-man-pages --enable-mca-no-build=btl-openib > "$work/configure.log" 2>&1
make -j"$(nproc)" > "$work/make.log" 2>&1
make install > "$work/install.log" 2>&1
"$prefix/bin/ompi_info" --parsable --all | grep -q -E "(mpi|opal)_built_with_cuda_support:value:true" \
    || { echo "built without CUDA support (see $work/configure.log)" >&2; exit 1; }
tar -cf - -C "$(dirname "$prefix")" "$(basename "$prefix")" | xz -T0 -6 > "$prefix.tar.xz"
echo "BUILT $prefix.tar.xz ($(du -h "$prefix.tar.xz" | cut -f1))"
