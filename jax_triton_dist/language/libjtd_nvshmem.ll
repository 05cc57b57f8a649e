; jax_triton_dist wrappers of NVSHMEM device functions (CUDA, nvshmem backend).
;
; Triton's extern calls need a result, and the NVSHMEM functions that move data return
; void: each wrapper calls one with integer addresses turned into pointers and returns 0.
; Linked (through Triton's extern_libs) before NVSHMEM's libnvshmem_device.bc, which
; defines the callees. The *_block functions are collective over the thread block: every
; thread of the program calls them, as Triton runs scalar code in every thread.

declare void @nvshmemx_putmem_nbi_block(ptr, ptr, i64, i32) convergent
declare void @nvshmemx_putmem_signal_nbi_block(ptr, ptr, i64, ptr, i64, i32, i32) convergent
declare void @nvshmemx_getmem_block(ptr, ptr, i64, i32) convergent
declare void @nvshmemx_signal_op(ptr, i64, i32, i32)
declare void @nvshmem_quiet()
declare void @nvshmem_fence()
declare i32 @nvshmem_my_pe()
declare i32 @nvshmem_n_pes()
declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.tid.y()
declare i32 @llvm.nvvm.read.ptx.sreg.tid.z()

define i32 @jtd_nvshmem_putmem_nbi_block(i64 %dest, i64 %src, i64 %nbytes, i32 %pe) convergent {
  %d = inttoptr i64 %dest to ptr
  %s = inttoptr i64 %src to ptr
  call void @nvshmemx_putmem_nbi_block(ptr %d, ptr %s, i64 %nbytes, i32 %pe)
  ret i32 0
}

define i32 @jtd_nvshmem_putmem_signal_nbi_block(i64 %dest, i64 %src, i64 %nbytes, i64 %sig,
                                                i64 %signal, i32 %op, i32 %pe) convergent {
  %d = inttoptr i64 %dest to ptr
  %s = inttoptr i64 %src to ptr
  %g = inttoptr i64 %sig to ptr
  call void @nvshmemx_putmem_signal_nbi_block(ptr %d, ptr %s, i64 %nbytes, ptr %g,
                                              i64 %signal, i32 %op, i32 %pe)
  ret i32 0
}

define i32 @jtd_nvshmem_getmem_block(i64 %dest, i64 %src, i64 %nbytes, i32 %pe) convergent {
  %d = inttoptr i64 %dest to ptr
  %s = inttoptr i64 %src to ptr
  call void @nvshmemx_getmem_block(ptr %d, ptr %s, i64 %nbytes, i32 %pe)
  ret i32 0
}

; One thread of the program updates the signal (it is not a collective call).
define i32 @jtd_nvshmem_signal_op(i64 %sig, i64 %signal, i32 %op, i32 %pe) convergent {
  %x = call i32 @llvm.nvvm.read.ptx.sreg.tid.x()
  %y = call i32 @llvm.nvvm.read.ptx.sreg.tid.y()
  %z = call i32 @llvm.nvvm.read.ptx.sreg.tid.z()
  %xy = or i32 %x, %y
  %xyz = or i32 %xy, %z
  %first = icmp eq i32 %xyz, 0
  br i1 %first, label %update, label %done
update:
  %g = inttoptr i64 %sig to ptr
  call void @nvshmemx_signal_op(ptr %g, i64 %signal, i32 %op, i32 %pe)
  br label %done
done:
  ret i32 0
}

define i32 @jtd_nvshmem_quiet() {
  call void @nvshmem_quiet()
  ret i32 0
}

define i32 @jtd_nvshmem_fence() {
  call void @nvshmem_fence()
  ret i32 0
}

define i32 @jtd_nvshmem_my_pe() {
  %v = call i32 @nvshmem_my_pe()
  ret i32 %v
}

define i32 @jtd_nvshmem_n_pes() {
  %v = call i32 @nvshmem_n_pes()
  ret i32 %v
}
