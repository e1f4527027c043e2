// Python module entry point for hyper_parallel._C and the engine's build-info op.
//
// Importing hyper_parallel._C loads this shared library, which runs every TORCH_LIBRARY /
// TORCH_LIBRARY_FRAGMENT registration in csrc/. The module itself exports no Python symbols:
// all ops are reached through torch.ops.hyper_parallel.*.
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace hp_attn {
std::string cpu_engine_info();  // csrc/attention/attention_cpu.cpp
}

namespace hyper_parallel {

std::string engine_info() {
  std::string info = "hyper_parallel C++ engine";
#ifdef _OPENMP
  info += "; openmp";
#endif
  info += "; " + hp_attn::cpu_engine_info();
  return info;
}

}  // namespace hyper_parallel

TORCH_LIBRARY_FRAGMENT(hyper_parallel, m) {
  m.def("engine_info() -> str", &hyper_parallel::engine_info);
}

static struct PyModuleDef hp_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&hp_module); }
