// Registers fxstar._C's DiskFile, DiskIO and DiskIORequest (csrc/disk_io.hpp).
#pragma once
#include <pybind11/pybind11.h>

namespace fxstar {

void bind_disk_io(pybind11::module_& m);

}  // namespace fxstar
