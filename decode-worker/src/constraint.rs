//! Constrained decoding with llguidance: a request's grammar (sent by the router) masks
//! every sampling step to the tokens it allows. The token table is built once per worker
//! from the model's `tokenizer.json`; each constrained request gets its own matcher.
//!
//! The engine loop computes the next step's masks on a helper thread while the device
//! runs the step (see `engine_loop::State::step`), so grammar work stays off the
//! critical path; only a request's first token waits for its first mask.

use std::path::Path;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConstraintError {
    #[error("this model cannot decode under a grammar: {0}")]
    Unsupported(String),
    #[error("invalid grammar: {0}")]
    Grammar(String),
    #[error("the grammar rejected token {token}: {reason}")]
    Rejected { token: u32, reason: String },
}

/// The model's tokens as llguidance sees them (shared by every request's matcher).
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

/// The end-of-sentence token every grammar ends with.
const EOS: &str = "<｜end▁of▁sentence｜>";

mod tokenizers_json {
    /// The part of `tokenizer.json` that names the added tokens.
    #[derive(serde::Deserialize)]
    pub struct Added {
        pub added_tokens: Vec<Token>,
    }

    #[derive(serde::Deserialize)]
    pub struct Token {
        pub id: u32,
        pub content: String,
    }
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

/// Token bytes for a trie; ids are the model's, so masks line up with its logits.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }
}

impl Grammars {
    /// Build from a model directory's `tokenizer.json`: `None` when there is none (the
    /// model serves token ids only, so there is nothing to constrain).
    pub fn load(model_dir: &Path, vocab: usize) -> Result<Option<Self>, ConstraintError> {
        let path = model_dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| ConstraintError::Unsupported(e.to_string()))?;
        let codec: tokenizers_json::Added =
            serde_json::from_str(&text).map_err(|e| ConstraintError::Unsupported(e.to_string()))?;
        let eos = codec
            .added_tokens
            .iter()
            .find(|t| t.content == EOS)
            .map(|t| t.id)
            .ok_or_else(|| ConstraintError::Unsupported(format!("tokenizer.json has no {EOS} token")))?;
        Self::from_tokenizer_json(&text, vocab, eos).map(Some)
    }

    pub fn from_tokenizer_json(text: &str, vocab: usize, eos: u32) -> Result<Self, ConstraintError> {
        let mut json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ConstraintError::Unsupported(e.to_string()))?;
        // Every added token (roles, `</think>`, DSML) counts as special: plain text can
        // then never spell one, and grammars name them by id.
        if let Some(added) = json["added_tokens"].as_array_mut() {
            for t in added {
                t["special"] = serde_json::Value::Bool(true);
            }
        }
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| ConstraintError::Unsupported(e.to_string()))?;
        // Ids the tokenizer does not name (the model's vocabulary can be larger) stay empty:
        // no grammar ever allows them.
        words.resize(vocab.max(words.len()), Vec::new());
        words.truncate(vocab);
        let info = TokRxInfo::new(vocab as u32, eos);
        let env: TokEnv = Arc::new(Env { trie: TokTrie::from(&info, &words) });
        let factory = ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Unsupported(e.to_string()))?;
        Ok(Grammars { factory: Arc::new(factory) })
    }

    /// A matcher for one request's grammar.
    pub fn matcher(&self, lark: &str) -> Result<Constraint, ConstraintError> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .map_err(|e| ConstraintError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Grammar(e));
        }
        Ok(Constraint { matcher })
    }
}

/// One request's grammar state: which tokens may come next.
pub struct Constraint {
    matcher: Matcher,
}

/// The tokens allowed at one step.
pub struct Mask(SimpleVob);

impl Mask {
    pub fn allows(&self, token: u32) -> bool {
        self.0.is_allowed(token)
    }
}

impl Constraint {
    /// The tokens allowed next (only end-of-sentence once the grammar is complete).
    pub fn mask(&mut self) -> Result<Mask, ConstraintError> {
        self.matcher.compute_mask_or_eos().map(Mask).map_err(|e| ConstraintError::Grammar(e.to_string()))
    }

    /// Advance past a sampled token.
    pub fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token).map_err(|e| ConstraintError::Rejected { token, reason: e.to_string() })
    }

    /// The grammar state after `tokens` (a migrated request's already-emitted tokens):
    /// the same as that of the matcher that allowed them one by one.
    pub fn replayed(mut self, tokens: &[u32]) -> Result<Self, ConstraintError> {
        for &t in tokens {
            self.commit(t)?;
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> (Grammars, tokenizers::Tokenizer) {
        let json = engine::init::tokenizer_json(320).unwrap();
        let tok: tokenizers::Tokenizer = json.parse().unwrap();
        (Grammars::from_tokenizer_json(&json, 320, 1).unwrap(), tok)
    }

    /// Decode greedily under `lark` with `pick` choosing among the allowed tokens; returns
    /// the text up to end-of-sentence.
    fn run(lark: &str, pick: impl Fn(&Mask, usize) -> u32) -> String {
        let (g, tok) = tiny();
        let mut c = g.matcher(lark).unwrap();
        let mut ids = Vec::new();
        for step in 0..400 {
            let mask = c.mask().unwrap();
            let t = pick(&mask, step);
            assert!(mask.allows(t));
            if t == 1 {
                return tok.decode(&ids, false).unwrap();
            }
            c.commit(t).unwrap();
            ids.push(t);
        }
        panic!("no end-of-sentence within 400 tokens: {:?}", tok.decode(&ids, false));
    }

    /// The allowed token with the highest pseudo-random score (a stand-in for a model).
    fn scrambled(mask: &Mask, step: usize) -> u32 {
        (0..320u32).filter(|&t| mask.allows(t)).max_by_key(|&t| (t as usize * 7919 + step * 104729) % 1009).unwrap()
    }

    #[test]
    fn json_schema_output_parses_and_fits_the_schema() {
        let schema = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":99},"ok":{"type":"boolean"}},"required":["n","ok"],"additionalProperties":false}"#;
        let text = run(&format!("start: %json {schema}\n"), scrambled);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v["n"].as_u64().is_some_and(|n| n <= 99) && v["ok"].is_boolean(), "{text}");
    }

    #[test]
    fn a_replayed_grammar_allows_what_the_original_allows_next() {
        let schema = r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#;
        let lark = format!("start: %json {schema}\n");
        let (g, _) = tiny();
        let mut original = g.matcher(&lark).unwrap();
        let mut emitted = Vec::new();
        for step in 0..6 {
            let t = scrambled(&original.mask().unwrap(), step);
            original.commit(t).unwrap();
            emitted.push(t);
        }
        let mut replayed = g.matcher(&lark).unwrap().replayed(&emitted).unwrap();
        let allowed = |m: &mut Constraint| {
            let mask = m.mask().unwrap();
            (0..320u32).filter(|&t| mask.allows(t)).collect::<Vec<_>>()
        };
        let next = allowed(&mut original);
        assert!(!next.is_empty() && next.len() < 320, "a mid-object mask restricts something: {next:?}");
        assert_eq!(allowed(&mut replayed), next);
        // A token the grammar never allowed cannot be replayed into it.
        let wrong = (0..320u32).find(|t| !g.matcher(&lark).unwrap().mask().unwrap().allows(*t)).unwrap();
        assert!(matches!(
            g.matcher(&lark).unwrap().replayed(&[wrong]),
            Err(ConstraintError::Rejected { token, .. }) if token == wrong
        ));
    }

    #[test]
    fn special_tokens_are_named_by_id_and_never_spelled_by_text() {
        // `</think>` is id 5 in `model init`'s tokenizer; reasoning runs free until it.
        let lark = "start: R <[5]> \"done\"\nR: /(.|\\n)*/\n";
        let (g, _) = tiny();
        let mut c = g.matcher(lark).unwrap();
        for t in [70u32, 80, 90] {
            assert!(c.mask().unwrap().allows(t));
            c.commit(t).unwrap();
        }
        let mask = c.mask().unwrap();
        assert!(mask.allows(5) && !mask.allows(1) && !mask.allows(2), "only text or </think> may follow");
        c.commit(5).unwrap();
        assert!(c.commit(5).is_err(), "after </think> only `done`");
    }
}
