// A no-op device guard for CUDA, for a CPU-only torch build (which has none): Python
// methods on a tensor of device "cuda:0" (copy_, index_copy_, indexing) take a device
// guard before they dispatch, even when the tensor is a FakeTensor that never needs one.
// Loaded by tests/fake_cuda/__init__.py only; never part of localserve.
#include <c10/core/impl/DeviceGuardImplInterface.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
