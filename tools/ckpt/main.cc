// ckpt: the command-line tool of ckptfs.
#include "commands.h"

int main(int argc, char** argv) { return ckptfs::cli::Main(argc, argv); }
