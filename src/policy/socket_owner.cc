#include "egressd/socket_owner.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>

namespace egressd {

std::string process_holding_socket(const std::string& inode) {
  const std::string needle = "socket:[" + inode + "]";
  std::string out;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* e = ::readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const std::string fds = std::string("/proc/") + e->d_name + "/fd";
    DIR* d = ::opendir(fds.c_str());
    if (d == nullptr) continue;
    bool found = false;
    while (dirent* f = ::readdir(d)) {
      char target[64];
      const std::string path = fds + "/" + f->d_name;
      const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      target[n] = 0;
      if (needle == target) {
        found = true;
        break;
      }
    }
    ::closedir(d);
    if (found) {
      std::ifstream comm(std::string("/proc/") + e->d_name + "/comm");
      std::string name;
      std::getline(comm, name);
      out = std::string("pid ") + e->d_name + " (" + name + ")";
      break;
    }
  }
  ::closedir(proc);
  return out;
}

}  // namespace egressd
