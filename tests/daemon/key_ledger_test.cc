#include "daemon/sidecar/key_ledger.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace accord::daemon {
namespace {

v1::KeyValueSetRequest SetOf(const std::string& job, const std::string& run, const std::string& key,
                             const std::string& value) {
  v1::KeyValueSetRequest r;
  r.set_job_id(job);
  r.set_run_id(run);
  r.set_key(key);
  r.set_value(value);
  return r;
}

std::vector<std::string> Keys(const KeyLedger& ledger) {
  std::vector<std::string> out;
  for (const v1::KeyValueSetRequest& r : ledger.All()) {
    out.push_back(r.job_id() + "/" + r.run_id() + ":" + r.key() + "=" + r.value());
  }
  return out;
}

TEST(KeyLedgerTest, KeepsEachRunsSetsInOrderAndASecondSetOfAKeyReplacesIt) {
  KeyLedger ledger;
  ledger.Note(SetOf("a", "r1", "boot/0", "x"));
  ledger.Note(SetOf("b", "r9", "boot/0", "y"));
  ledger.Note(SetOf("a", "r1", "boot/1", "zz"));
  ledger.Note(SetOf("a", "r1", "boot/0", "x"));  // a retried Set
  EXPECT_EQ(Keys(ledger),
            (std::vector<std::string>{"a/r1:boot/0=x", "a/r1:boot/1=zz", "b/r9:boot/0=y"}));
  EXPECT_EQ(ledger.bytes(), (6 + 1) + (6 + 2) + (6 + 1));
  EXPECT_EQ(ledger.scopes(), 2);
}

TEST(KeyLedgerTest, PruneAndForgetDropWholeScopesAndTheirBytes) {
  KeyLedger ledger;
  ledger.Note(SetOf("a", "r1", "k", "1"));
  ledger.Note(SetOf("a", "r2", "k", "2"));
  ledger.Note(SetOf("b", "r1", "k", "3"));
  ledger.Prune([](const std::string& job, const std::string& run) {
    return !(job == "a" && run == "r1");  // a's first run ended
  });
  EXPECT_EQ(Keys(ledger), (std::vector<std::string>{"a/r2:k=2", "b/r1:k=3"}));
  ledger.Forget("b", "r1");
  EXPECT_EQ(Keys(ledger), (std::vector<std::string>{"a/r2:k=2"}));
  EXPECT_EQ(ledger.bytes(), 2);
}

TEST(KeyLedgerTest, PastTheBoundTheOldestScopeGoesButNeverTheNewest) {
  KeyLedger ledger(/*max_bytes=*/10);
  ledger.Note(SetOf("a", "r", "k", "1234"));  // 5 bytes
  ledger.Note(SetOf("b", "r", "k", "1234"));  // 10 in all: kept
  EXPECT_EQ(ledger.scopes(), 2);
  ledger.Note(SetOf("c", "r", "k", "1234"));  // 15: a goes
  EXPECT_EQ(Keys(ledger), (std::vector<std::string>{"b/r:k=1234", "c/r:k=1234"}));
  ledger.Note(SetOf("c", "r", "big", std::string(20, 'v')));  // c alone is past the bound
  EXPECT_EQ(ledger.scopes(), 1);
  EXPECT_EQ(ledger.bytes(), 5 + 23);
}

}  // namespace
}  // namespace accord::daemon
