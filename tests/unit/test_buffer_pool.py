"""axo4d.dist.buffers.BufferPool: CPU buffers handed back are reused, the smallest that fits first."""

import torch

from axo4d.dist.buffers import BufferPool


def test_a_buffer_given_back_is_reused_smallest_fit_first_and_per_dtype():
    pool = BufferPool()
    big, small = pool.take(100, torch.float32, "cpu"), pool.take(10, torch.float32, "cpu")
    assert big.numel() == 100 and small.numel() == 10
    pool.give(big)
    pool.give(small)
    assert pool.held_bytes() == 440
    again = pool.take(8, torch.float32, "cpu")  # the 10-element buffer fits: it, not the 100
    assert again.numel() == 8 and again.data_ptr() == small.data_ptr()
    assert pool.take(8, torch.float64, "cpu").data_ptr() not in (big.data_ptr(), small.data_ptr())
    reused = pool.take(50, torch.float32, "cpu")
    assert reused.data_ptr() == big.data_ptr() and pool.held_bytes() == 0
    pool.give(reused)  # a view: its whole buffer goes back
    assert pool.held_bytes() == 400
    assert pool.take(101, torch.float32, "cpu").data_ptr() != big.data_ptr()  # too small: a new one


def test_off_the_cpu_buffers_are_left_to_the_device_allocator():
    pool = BufferPool()
    t = pool.take(16, torch.float32, "meta")
    assert t.device.type == "meta" and t.numel() == 16
    pool.give(t)
    assert pool.held_bytes() == 0
