// Reading committed fixtures in tests: a safetensors file under fixtures/, tensors widened to f32/i64.
#pragma once

#include "../chapters/01_safetensors.hpp"
#include "check.hpp"

namespace kimik3::test {

struct Fixture {
    SafetensorsFile file;
    explicit Fixture(const std::string& rel) : file(source_path(rel)) {}
    std::vector<float> f32(const std::string& name) const { return to_f32(file.read(name)); }
    std::vector<std::int64_t> i64(const std::string& name) const { return to_i64(file.read(name)); }
    Tensor raw(const std::string& name) const { return file.read(name); }
    Shape shape(const std::string& name) const { return file.get(name).shape; }
};

}  // namespace kimik3::test
