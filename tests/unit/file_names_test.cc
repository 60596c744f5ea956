// File names of a checkpoint's files: the escaping is reversible and never yields a
// name a directory cannot hold.
#include "io/file_names.h"

#include <gtest/gtest.h>

#include <random>

namespace ckptfs {
namespace {

TEST(FileNames, EscapesWhatAFileNameCannotHold) {
  EXPECT_EQ(FileNameFor("model/layers.0/weight", ".npy"), "model%2Flayers.0%2Fweight.npy");
  EXPECT_EQ(FileNameFor("50%", ""), "50%25");
  EXPECT_EQ(FileNameFor(".", ""), "%2E");
  EXPECT_EQ(FileNameFor("..", ""), "%2E.");
  EXPECT_EQ(FileNameFor(".hidden", ".npy"), ".hidden.npy");
  EXPECT_EQ(FileNameFor("tab\there", ""), "tab%09here");
  EXPECT_EQ(FileNameFor("unicodé", ".npy"), "unicodé.npy");
  // '~' marks shortened names only, so an escaped name never looks like one.
  EXPECT_EQ(FileNameFor("a~0123456789abcdef", ""), "a%7E0123456789abcdef");
}

TEST(FileNames, EscapingIsReversible) {
  std::mt19937 rng(1);
  for (int i = 0; i < 2000; ++i) {
    std::string name;
    int len = 1 + rng() % 40;
    for (int k = 0; k < len; ++k) name.push_back(static_cast<char>(1 + rng() % 255));
    std::string file = FileNameFor(name, "");
    EXPECT_EQ(file.find('/'), std::string::npos);
    EXPECT_NE(file, ".");
    EXPECT_NE(file, "..");
    EXPECT_EQ(UnescapeName(file), name);
  }
  EXPECT_FALSE(UnescapeName("bad%2").has_value());
  EXPECT_FALSE(UnescapeName("bad%zz").has_value());
}

TEST(FileNames, LongNamesAreShortenedUniquely) {
  std::string a(300, 'a'), b = a;
  b.back() = 'b';
  std::string fa = FileNameFor(a, ".npy"), fb = FileNameFor(b, ".npy");
  EXPECT_LE(fa.size(), 255u);
  EXPECT_NE(fa, fb);
  EXPECT_EQ(fa.substr(0, 200), a.substr(0, 200));
  EXPECT_EQ(fa[200], '~');
  // A name that is not shortened cannot collide with one that is.
  std::string lookalike = fa.substr(0, fa.size() - 4);
  EXPECT_NE(FileNameFor(lookalike, ".npy"), fa);
}

}  // namespace
}  // namespace ckptfs
