"""How rows map to edges and operands: the compile-time flags of one kernel variant."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Layout:
    """csr: a row walks the edges rowptr[row]..rowptr[row+1], else row == edge. perm: edge position -> edge id. xidx /
    gidx: an edge's in1 / grad-out row (else the row). atomic: results added to oidx[eid] / xidx[eid] (grad x). table:
    weights from a radial table (grad r, not grad W). fixed: grad x added in 64-bit fixed point (atomic and csr).
    grad_x False: no grad x formed (the backward may walk the forward's rows)."""

    csr: bool = False
    perm: bool = False
    xidx: bool = False
    gidx: bool = False
    atomic: bool = False
    table: bool = False
    grad_x: bool = True
    fixed: bool = False

    def tag(self) -> str:
        flags = "".join(k[0] if getattr(self, k) else "_" for k in ("csr", "perm", "xidx", "gidx", "atomic"))
        # names of the kernels without a table (or with grad x, or without fixed point) as before
        return flags + ("t" if self.table else "") + ("" if self.grad_x else "n") + ("f" if self.fixed else "")

    def with_table(self) -> Layout:
        return replace(self, table=True)


TP_LAYOUT = Layout()
# The convolution's kernels: deterministic (CSR over receivers forward, over senders backward) and atomic.
CONV_FORWARD = Layout(csr=True, perm=True, xidx=True)
CONV_FORWARD_SORTED = Layout(csr=True, perm=False, xidx=True)  # edges already sorted by receiver
CONV_BACKWARD = Layout(csr=True, perm=True, gidx=True)
# A backward with no grad x over the forward's rows: grad y and grad W (r) are per edge, any row order serves.
CONV_BACKWARD_NO_GX = Layout(csr=True, perm=True, xidx=True, grad_x=False)
CONV_BACKWARD_NO_GX_SORTED = Layout(csr=True, perm=False, xidx=True, grad_x=False)
# The same walk with grad x added to the senders' rows by atomics (opt-in: its bits vary from run to run).
CONV_BACKWARD_RECEIVERS = Layout(csr=True, perm=True, xidx=True, atomic=True)
CONV_BACKWARD_RECEIVERS_SORTED = Layout(csr=True, perm=False, xidx=True, atomic=True)
# ... with grad x in fixed point: the same bits every run (TPTuning.receiver_backward_fixed_point)
CONV_BACKWARD_RECEIVERS_FIXED = replace(CONV_BACKWARD_RECEIVERS, fixed=True)
CONV_BACKWARD_RECEIVERS_FIXED_SORTED = replace(CONV_BACKWARD_RECEIVERS_SORTED, fixed=True)
ATOMIC_FORWARD = Layout(xidx=True, atomic=True)
ATOMIC_BACKWARD = Layout(xidx=True, gidx=True, atomic=True)
