use std::collections::BTreeMap;

use super::Member;

/// The member list as reconstructed from etcd keys under one prefix.
///
/// Keyed by etcd key so that deletes, which carry only the key, find their member; kept sorted so
/// that every watcher publishes members in the same (id) order.
#[derive(Debug)]
pub(crate) struct MemberTable {
    prefix: String,
    members: BTreeMap<Vec<u8>, Member>,
}

impl MemberTable {
    pub(crate) fn new(prefix: String) -> Self {
        Self { prefix, members: BTreeMap::new() }
    }

    pub(crate) fn members(&self) -> Vec<Member> {
        self.members.values().cloned().collect()
    }

    /// Applies a put; returns whether the member list changed.
    ///
    /// A value that is not a valid member of this key is logged and treated as the member's
    /// absence: placing work on a half-understood entry is worse than not placing it.
    pub(crate) fn put(&mut self, key: &[u8], value: &[u8]) -> bool {
        match self.decode(key, value) {
            Ok(member) => self.members.insert(key.to_vec(), member.clone()).is_none_or(|old| old != member),
            Err(reason) => {
                tracing::warn!(key = %String::from_utf8_lossy(key), %reason, "ignoring invalid member entry");
                self.members.remove(key).is_some()
            }
        }
    }

    /// Applies a delete (explicit, or a lease expiring); returns whether the member list changed.
    pub(crate) fn delete(&mut self, key: &[u8]) -> bool {
        self.members.remove(key).is_some()
    }

    /// Replaces everything with a fresh listing; returns whether the member list changed.
    pub(crate) fn replace<'a>(&mut self, entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> bool {
        let old = std::mem::take(&mut self.members);
        for (key, value) in entries {
            self.put(key, value);
        }
        old != self.members
    }

    fn decode(&self, key: &[u8], value: &[u8]) -> Result<Member, String> {
        let key = std::str::from_utf8(key).map_err(|_| "key is not UTF-8".to_owned())?;
        let id = key.strip_prefix(&self.prefix).ok_or_else(|| format!("key is not under {}", self.prefix))?;
        let member: Member = serde_json::from_slice(value).map_err(|e| format!("not member JSON: {e}"))?;
        // Two keys claiming one id would put one process into placement twice.
        if member.id != id {
            return Err(format!("member id {:?} does not match its key", member.id));
        }
        Ok(member)
    }
}

#[cfg(test)]
mod tests {
    use super::super::Role;
    use super::*;

    const PREFIX: &str = "/sluice/t/members/";

    fn member(id: &str, role: Role, pages: u64) -> Member {
        Member {
            id: id.into(),
            role,
            grpc_addr: format!("http://{id}:1"),
            ucx_address: None,
            model: "m".into(),
            fingerprint: "f".into(),
            capacity: serde_json::json!({ "pages": pages }),
        }
    }

    fn key(id: &str) -> Vec<u8> {
        format!("{PREFIX}{id}").into_bytes()
    }

    fn json(m: &Member) -> Vec<u8> {
        serde_json::to_vec(m).unwrap()
    }

    fn ids(t: &MemberTable) -> Vec<String> {
        t.members().into_iter().map(|m| m.id).collect()
    }

    #[test]
    fn puts_and_deletes_change_the_list_in_id_order() {
        let mut t = MemberTable::new(PREFIX.into());
        assert!(t.put(&key("b"), &json(&member("b", Role::Decode, 1))));
        assert!(t.put(&key("a"), &json(&member("a", Role::Prefill, 1))));
        assert_eq!(ids(&t), ["a", "b"]);
        assert!(t.delete(&key("a")));
        assert!(!t.delete(&key("a")), "deleting an absent member changes nothing");
        assert_eq!(ids(&t), ["b"]);
    }

    #[test]
    fn an_identical_put_is_not_a_change_but_a_new_capacity_is() {
        let mut t = MemberTable::new(PREFIX.into());
        let m = member("a", Role::Decode, 1);
        assert!(t.put(&key("a"), &json(&m)));
        assert!(!t.put(&key("a"), &json(&m)));
        assert!(t.put(&key("a"), &json(&member("a", Role::Decode, 2))));
        assert_eq!(t.members()[0].capacity["pages"], 2);
    }

    #[test]
    fn invalid_entries_are_ignored_and_drop_a_previous_valid_value() {
        let mut t = MemberTable::new(PREFIX.into());
        assert!(!t.put(&key("x"), b"not json"));
        assert!(!t.put(&key("y"), &json(&member("other", Role::Decode, 1))), "id must match the key");
        assert!(!t.put(b"/elsewhere/z", &json(&member("z", Role::Decode, 1))));
        assert!(t.members().is_empty());

        assert!(t.put(&key("a"), &json(&member("a", Role::Decode, 1))));
        assert!(t.put(&key("a"), b"{}"));
        assert!(t.members().is_empty());
    }

    #[test]
    fn a_listing_replaces_everything() {
        let mut t = MemberTable::new(PREFIX.into());
        t.put(&key("gone"), &json(&member("gone", Role::Decode, 1)));
        t.put(&key("kept"), &json(&member("kept", Role::Decode, 1)));
        let (kk, kv) = (key("kept"), json(&member("kept", Role::Decode, 1)));
        let (nk, nv) = (key("new"), json(&member("new", Role::Prefill, 1)));
        assert!(t.replace([(kk.as_slice(), kv.as_slice()), (nk.as_slice(), nv.as_slice())]));
        assert_eq!(ids(&t), ["kept", "new"]);
        assert!(!t.replace([(kk.as_slice(), kv.as_slice()), (nk.as_slice(), nv.as_slice())]));
    }
}
