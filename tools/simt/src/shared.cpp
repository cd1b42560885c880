// SIMT emulator (tools/simt): finds the __shared__ arrays of a kernel so the
// block scheduler can fill them with a poison pattern before every block
// (shared memory is uninitialised when a block starts on a GPU; without the
// poison, a block would read what the previous block left there).
//
// `__shared__` is `static` in the emulator (include/simt/prelude.h), so a
// kernel's shared arrays are the static locals of the kernel function. Their
// symbols are in the library's own ELF symbol table (.symtab): a static local
// `x` of a function with mangled name _Z<encoding> is _ZZ<encoding>E<len>x.
#include "internal.h"

#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <elf.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace simt {
namespace {

struct Symbols {
  uintptr_t base = 0;
  std::unordered_map<uintptr_t, std::string> functions;  // address -> mangled name
  std::vector<std::pair<std::string, SharedArray>> objects;  // writable data objects
};

void anchor() {}

Symbols read_symbols() {
  Dl_info info{};
  TORCH_CHECK(dladdr(reinterpret_cast<void*>(&anchor), &info) != 0 && info.dli_fname != nullptr,
              "simt: cannot locate the emulator library");
  std::ifstream file(info.dli_fname, std::ios::binary);
  const std::string elf((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  TORCH_CHECK(elf.size() > sizeof(Elf64_Ehdr) && std::memcmp(elf.data(), ELFMAG, SELFMAG) == 0,
              "simt: ", info.dli_fname, " is not an ELF file");
  Symbols out;
  out.base = reinterpret_cast<uintptr_t>(info.dli_fbase);
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(elf.data());
  const auto* sections = reinterpret_cast<const Elf64_Shdr*>(elf.data() + eh->e_shoff);
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (sections[i].sh_type != SHT_SYMTAB) continue;
    const Elf64_Shdr& strtab = sections[sections[i].sh_link];
    const char* names = elf.data() + strtab.sh_offset;
    const auto* syms = reinterpret_cast<const Elf64_Sym*>(elf.data() + sections[i].sh_offset);
    const size_t count = sections[i].sh_size / sizeof(Elf64_Sym);
    for (size_t k = 0; k < count; ++k) {
      const Elf64_Sym& s = syms[k];
      if (s.st_shndx == SHN_UNDEF || s.st_shndx >= eh->e_shnum) continue;
      const std::string name = names + s.st_name;
      if (ELF64_ST_TYPE(s.st_info) == STT_FUNC) {
        out.functions.emplace(out.base + s.st_value, name);
      } else if (ELF64_ST_TYPE(s.st_info) == STT_OBJECT && name.rfind("_ZZ", 0) == 0 &&
                 (sections[s.st_shndx].sh_flags & SHF_WRITE) != 0 &&
                 (sections[s.st_shndx].sh_flags & SHF_TLS) == 0) {
        out.objects.emplace_back(name, SharedArray{reinterpret_cast<void*>(out.base + s.st_value),
                                                   static_cast<size_t>(s.st_size)});
      }
    }
  }
  TORCH_CHECK(!out.functions.empty(), "simt: ", info.dli_fname,
              " has no symbol table (stripped?): cannot find the kernels' shared memory");
  return out;
}

}  // namespace

const std::vector<SharedArray>& shared_arrays(const void* kernel) {
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<const void*, std::vector<SharedArray>>;
  static const Symbols* symbols = nullptr;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(kernel);
  if (it != cache->end()) return it->second;
  if (symbols == nullptr) symbols = new Symbols(read_symbols());
  auto fn = symbols->functions.find(reinterpret_cast<uintptr_t>(kernel));
  TORCH_CHECK(fn != symbols->functions.end() && fn->second.rfind("_Z", 0) == 0,
              "simt: no symbol for a launched kernel");
  const std::string prefix = "_ZZ" + fn->second.substr(2) + "E";
  std::vector<SharedArray> arrays;
  for (const auto& [name, array] : symbols->objects) {
    if (name.rfind(prefix, 0) == 0) arrays.push_back(array);
  }
  return cache->emplace(kernel, std::move(arrays)).first->second;
}

}  // namespace simt
