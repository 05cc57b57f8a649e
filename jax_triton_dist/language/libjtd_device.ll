; jax_triton_dist device library (CUDA): the rank context of a compiled kernel.
;
; The runtime loads one copy of each kernel module per (call site, device) and sets
; @jtd_ctx to the device address of that rank's context:
;   offset  0  i32 rank
;   offset  4  i32 num_ranks
;   offset  8  i32 epoch            (written on the stream before every launch)
;   offset 12  i32 reserved
;   offset 16  i64 barrier_area     (address of num_ranks u64 counters)
;   offset 24  i64 timeout_ns       (dl.wait watchdog)
;   offset 32  i64 heap_base[num_ranks]
;   then       i32 pe[num_ranks]    (each rank's SHMEM PE: NVSHMEM device calls take PEs)
; Linked into kernels through Triton's extern_libs (text IR is accepted).

@jtd_ctx = addrspace(1) externally_initialized global i64 0, align 8

define internal ptr addrspace(1) @jtd_field(i64 %offset) alwaysinline {
  %base = load i64, ptr addrspace(1) @jtd_ctx, align 8
  %addr = add i64 %base, %offset
  %p = inttoptr i64 %addr to ptr addrspace(1)
  ret ptr addrspace(1) %p
}

define i32 @jtd_rank() alwaysinline {
  %p = call ptr addrspace(1) @jtd_field(i64 0)
  %v = load i32, ptr addrspace(1) %p, align 4
  ret i32 %v
}

define i32 @jtd_num_ranks() alwaysinline {
  %p = call ptr addrspace(1) @jtd_field(i64 4)
  %v = load i32, ptr addrspace(1) %p, align 4
  ret i32 %v
}

define i32 @jtd_epoch() alwaysinline {
  %p = call ptr addrspace(1) @jtd_field(i64 8)
  %v = load volatile i32, ptr addrspace(1) %p, align 4
  ret i32 %v
}

define i64 @jtd_barrier_area() alwaysinline {
  %p = call ptr addrspace(1) @jtd_field(i64 16)
  %v = load i64, ptr addrspace(1) %p, align 8
  ret i64 %v
}

define i64 @jtd_timeout_ns() alwaysinline {
  %p = call ptr addrspace(1) @jtd_field(i64 24)
  %v = load i64, ptr addrspace(1) %p, align 8
  ret i64 %v
}

define i64 @jtd_heap_base(i32 %rank) alwaysinline {
  %r = sext i32 %rank to i64
  %scaled = mul i64 %r, 8
  %offset = add i64 %scaled, 32
  %p = call ptr addrspace(1) @jtd_field(i64 %offset)
  %v = load i64, ptr addrspace(1) %p, align 8
  ret i64 %v
}

define i32 @jtd_pe(i32 %rank) alwaysinline {
  %n = call i32 @jtd_num_ranks()
  %n64 = sext i32 %n to i64
  %table = mul i64 %n64, 8
  %start = add i64 %table, 32
  %r = sext i32 %rank to i64
  %scaled = mul i64 %r, 4
  %offset = add i64 %start, %scaled
  %p = call ptr addrspace(1) @jtd_field(i64 %offset)
  %v = load i32, ptr addrspace(1) %p, align 4
  ret i32 %v
}
