// Which process holds a socket, by the socket's inode: for messages that name
// who took something egressd needs (a DNS port, a network namespace's claim).
#pragma once

#include <string>

namespace egressd {

// "pid 42 (python3)": the first process with a descriptor of socket:[inode],
// from /proc/<pid>/fd; "" when none is found (the socket may be gone already,
// or its process is not in this process's pid namespace). Bounded by the
// processes and descriptors there are.
std::string process_holding_socket(const std::string& inode);

}  // namespace egressd
