//! Keeps fp8-sys and include/fp8.h from drifting apart.
//!
//! It parses the header (FP8_HEADER, else ../../include/fp8.h from the workspace) and this crate's
//! src/lib.rs, and fails with a list of every difference:
//!  - functions: every `FP8_API` function of the header is declared in the crate and the other way
//!    round, with the same number of parameters, the same parameter types and the same return type
//!    (C types mapped to Rust's: `int32_t` -> `i32`, `const T *` -> `*const T`, `T *const *` ->
//!    `*const *mut T`, typedefs resolved on both sides);
//!  - constants: every `#define FP8_<NAME> <value>` (an integer, a float or an expression of them
//!    and earlier constants) exists as `pub const FP8_<NAME>` with the same value and kind (integer
//!    or float), and the crate has no FP8_ constant the header lacks;
//!  - typedefs: opaque handles (`typedef struct X X_t`), integer typedefs, function-pointer
//!    typedefs (parameters and return type) and forward-declared structs;
//!  - structs: each struct of the header (the versioned ones, those that begin with struct_size,
//!    and the others) has the same fields in the same order with the same types; and, where a C
//!    compiler is found (CC, else cc), the same size, alignment, field offsets and field sizes as
//!    the C compiler gives (`layout_matches_c`).
//!
//! Anything in the header this parser does not understand is itself reported, so that a new kind
//! of declaration cannot slip past unchecked.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

/* ---- inputs --------------------------------------------------------------------------------- */

fn header_path() -> PathBuf {
    match std::env::var_os("FP8_HEADER") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../include/fp8.h"),
    }
}

fn read(path: &PathBuf) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/* ---- types, as both sides are compared ------------------------------------------------------ */

#[derive(Clone, Debug, PartialEq)]
enum Ty {
    /// A primitive in Rust's spelling (i32, usize, f32, c_char, void, ...).
    Prim(String),
    /// A struct, an opaque type or a function-pointer typedef, by name.
    Named(String),
    Ptr {
        mutable: bool,
        to: Box<Ty>,
    },
    Array(Box<Ty>, i128),
    FnPtr {
        params: Vec<Ty>,
        ret: Box<Ty>,
    },
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ty::Prim(p) if p == "void" => write!(f, "c_void"),
            Ty::Prim(p) | Ty::Named(p) => write!(f, "{p}"),
            Ty::Ptr { mutable, to } => write!(f, "*{} {to}", if *mutable { "mut" } else { "const" }),
            Ty::Array(t, n) => write!(f, "[{t}; {n}]"),
            Ty::FnPtr { params, ret } => {
                let p: Vec<String> = params.iter().map(|t| t.to_string()).collect();
                write!(f, "fn({}) -> {ret}", p.join(", "))
            }
        }
    }
}

/// Return types print `()` for void.
fn show_ret(t: &Ty) -> String {
    if *t == Ty::Prim("void".into()) {
        "()".into()
    } else {
        t.to_string()
    }
}

/// Replaces typedef names by what they stand for (repeatedly), everywhere inside `t`.
fn resolve(t: &Ty, aliases: &BTreeMap<String, Ty>) -> Ty {
    match t {
        Ty::Named(n) => match aliases.get(n) {
            Some(target) if target != t => resolve(target, aliases),
            _ => t.clone(),
        },
        Ty::Prim(_) => t.clone(),
        Ty::Ptr { mutable, to } => Ty::Ptr { mutable: *mutable, to: Box::new(resolve(to, aliases)) },
        Ty::Array(e, n) => Ty::Array(Box::new(resolve(e, aliases)), *n),
        Ty::FnPtr { params, ret } => Ty::FnPtr {
            params: params.iter().map(|p| resolve(p, aliases)).collect(),
            ret: Box::new(resolve(ret, aliases)),
        },
    }
}

/* ---- tokens and constant expressions (shared by both parsers) ------------------------------- */

fn tokenize(s: &str) -> Vec<String> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i] as char;
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(s[start..i].to_string());
        } else if c.is_ascii_digit() || (c == '.' && i + 1 < b.len() && (b[i + 1] as char).is_ascii_digit()) {
            let start = i;
            while i < b.len() {
                let d = b[i] as char;
                let exp_sign =
                    (d == '+' || d == '-') && matches!(b[i - 1], b'e' | b'E') && !s[start..i].starts_with("0x");
                if d.is_ascii_alphanumeric() || d == '.' || d == '_' || exp_sign {
                    i += 1;
                } else {
                    break;
                }
            }
            out.push(s[start..i].to_string());
        } else if c == '"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += 1;
            }
            i += 1;
            out.push(s[start..i.min(b.len())].to_string());
        } else {
            let two = if i + 1 < b.len() { &s[i..i + 2] } else { "" };
            if ["::", "->", "<<", ">>"].contains(&two) {
                out.push(two.to_string());
                i += 2;
            } else {
                out.push(c.to_string());
                i += 1;
            }
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Value {
    Int(i128),
    Float(f64),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(v) => write!(f, "{v}"),
            Value::Float(v) => write!(f, "{v:?}"),
        }
    }
}

/// A literal of either language: 0x1F, 12u, 1u32, 1_000, 600.0, 1e-3, 2.5f, 1.0f64.
fn literal(tok: &str) -> Option<Value> {
    let t = tok.replace('_', "");
    let lower = t.to_ascii_lowercase();
    if let Some(hex) = lower.strip_prefix("0x") {
        let digits: String = hex.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
        return i128::from_str_radix(&digits, 16).ok().map(Value::Int);
    }
    let is_float = lower.contains('.') || (lower.contains('e') && !lower.ends_with("size"));
    let body: String = if is_float {
        let trimmed = lower.trim_end_matches("f64").trim_end_matches("f32").trim_end_matches('f');
        trimmed.to_string()
    } else {
        lower.chars().take_while(|c| c.is_ascii_digit()).collect()
    };
    if is_float {
        body.parse::<f64>().ok().map(Value::Float)
    } else {
        // The rest must be an integer suffix: u, l, ul, ull, or a Rust type (u32, i64, usize).
        let suffix = &lower[body.len()..];
        let c_suffix = suffix.chars().all(|c| c == 'u' || c == 'l');
        let rust_suffix =
            ["u8", "u16", "u32", "u64", "u128", "usize", "i8", "i16", "i32", "i64", "i128", "isize"].contains(&suffix);
        if body.is_empty() || !(c_suffix || rust_suffix) {
            return None;
        }
        body.parse::<i128>().ok().map(Value::Int)
    }
}

/// Evaluates a constant expression: literals, earlier constants, unary - + ~, binary * / % + - << >>
/// & | ^, parentheses; Rust's `as <type>` casts are accepted (an integer cast to f32/f64 becomes a
/// float, anything else keeps its value).
struct Eval<'a> {
    toks: &'a [String],
    pos: usize,
    known: &'a BTreeMap<String, Value>,
}

impl Eval<'_> {
    fn run(toks: &[String], known: &BTreeMap<String, Value>) -> Result<Value, String> {
        let mut e = Eval { toks, pos: 0, known };
        let v = e.binary(1)?;
        if e.pos != toks.len() {
            return Err(format!("unexpected '{}'", toks[e.pos]));
        }
        Ok(v)
    }
    fn peek(&self) -> Option<&str> {
        self.toks.get(self.pos).map(|s| s.as_str())
    }
    fn prec(op: &str) -> Option<u8> {
        Some(match op {
            "|" => 1,
            "^" => 2,
            "&" => 3,
            "<<" | ">>" => 4,
            "+" | "-" => 5,
            "*" | "/" | "%" => 6,
            _ => return None,
        })
    }
    /// Precedence climbing: operators of precedence >= `min`, left-associative.
    fn binary(&mut self, min: u8) -> Result<Value, String> {
        let mut lhs = self.unary()?;
        while let Some(p) = self.peek().and_then(Self::prec) {
            if p < min {
                break;
            }
            let op = self.toks[self.pos].clone();
            self.pos += 1;
            let rhs = self.binary(p + 1)?;
            lhs = apply(&op, lhs, rhs)?;
        }
        Ok(lhs)
    }
    fn unary(&mut self) -> Result<Value, String> {
        let tok = self.peek().ok_or("expression ends early")?.to_string();
        self.pos += 1;
        let v = match tok.as_str() {
            "-" => match self.unary()? {
                Value::Int(v) => Value::Int(-v),
                Value::Float(v) => Value::Float(-v),
            },
            "+" => self.unary()?,
            "~" | "!" => match self.unary()? {
                Value::Int(v) => Value::Int(!v),
                Value::Float(_) => return Err("~ of a float".into()),
            },
            "(" => {
                let v = self.binary(1)?;
                if self.peek() != Some(")") {
                    return Err("missing ')'".into());
                }
                self.pos += 1;
                v
            }
            t => {
                if let Some(v) = t.starts_with(|c: char| c.is_ascii_digit() || c == '.').then(|| literal(t)).flatten() {
                    v
                } else if let Some(v) = self.known.get(t) {
                    *v
                } else {
                    return Err(format!("unknown name or token '{t}'"));
                }
            }
        };
        // Rust casts.
        if self.peek() == Some("as") {
            self.pos += 1;
            let ty = self.peek().ok_or("cast to nothing")?.to_string();
            self.pos += 1;
            return Ok(match (v, ty.as_str()) {
                (Value::Int(i), "f32" | "f64") => Value::Float(i as f64),
                _ => v,
            });
        }
        Ok(v)
    }
}

fn apply(op: &str, a: Value, b: Value) -> Result<Value, String> {
    use Value::*;
    Ok(match (a, b) {
        (Int(x), Int(y)) => Int(match op {
            "+" => x + y,
            "-" => x - y,
            "*" => x * y,
            "/" if y != 0 => x / y,
            "%" if y != 0 => x % y,
            "<<" => x << y,
            ">>" => x >> y,
            "&" => x & y,
            "|" => x | y,
            "^" => x ^ y,
            _ => return Err(format!("cannot apply {op}")),
        }),
        (x, y) => {
            let f = |v: Value| match v {
                Int(i) => i as f64,
                Float(f) => f,
            };
            let (x, y) = (f(x), f(y));
            Float(match op {
                "+" => x + y,
                "-" => x - y,
                "*" => x * y,
                "/" => x / y,
                _ => return Err(format!("cannot apply {op} to floats")),
            })
        }
    })
}

/* ---- the header ----------------------------------------------------------------------------- */

/// A function: its parameters (name, type), its return type and its declaration as written.
type Function = (Vec<(String, Ty)>, Ty, String);

#[derive(Debug, Default)]
struct Api {
    /// name -> (parameter names and types, return type, the declaration as written).
    functions: BTreeMap<String, Function>,
    /// Constants in declaration order: name, value, the text of the value.
    constants: Vec<(String, Value, String)>,
    /// Typedef name -> what it stands for (opaque and struct typedefs to Named(struct), integer
    /// typedefs to a Prim).
    aliases: BTreeMap<String, Ty>,
    /// Function-pointer typedefs.
    fn_ptrs: BTreeMap<String, Ty>,
    /// Structs with fields: name -> fields (name, type).
    structs: BTreeMap<String, Vec<(String, Ty)>>,
    /// Structs declared without fields (opaque or forward declarations).
    opaque: BTreeSet<String>,
    /// What the parser could not understand.
    problems: Vec<String>,
}

fn strip_c_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.map_or(true, |l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b + 2..].find("*/").map(|e| b + 2 + e + 2).unwrap_or(rest.len());
                // Keep line structure (defines are line based).
                out.extend(rest[b..end].chars().filter(|&c| c == '\n'));
                rest = &rest[end..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                let end = rest[l..].find('\n').map(|e| l + e).unwrap_or(rest.len());
                rest = &rest[end..];
            }
            (None, None) => {
                out.push_str(rest);
                return out;
            }
            _ => unreachable!(),
        }
    }
}

/// The C base-type words (qualifiers removed) as a Rust primitive, if they are one.
fn c_prim(words: &[&str]) -> Option<&'static str> {
    Some(match words {
        ["int8_t"] | ["signed", "char"] => "i8",
        ["int16_t"] | ["short"] | ["short", "int"] => "i16",
        ["int32_t"] | ["int"] | ["signed"] | ["signed", "int"] => "i32",
        ["int64_t"] | ["long", "long"] | ["long", "long", "int"] => "i64",
        ["uint8_t"] | ["unsigned", "char"] => "u8",
        ["uint16_t"] | ["unsigned", "short"] => "u16",
        ["uint32_t"] | ["unsigned"] | ["unsigned", "int"] => "u32",
        ["uint64_t"] | ["unsigned", "long", "long"] => "u64",
        ["size_t"] | ["uintptr_t"] => "usize",
        ["ptrdiff_t"] | ["intptr_t"] => "isize",
        ["float"] => "f32",
        ["double"] => "f64",
        ["char"] => "c_char",
        ["void"] => "void",
        _ => return None,
    })
}

const C_TYPE_WORDS: &[&str] =
    &["const", "volatile", "struct", "unsigned", "signed", "char", "short", "int", "long", "float", "double", "void"];

/// A C declaration (parameter or field) as written: its type, its name if it has one, and the
/// tokens of its array length if it is an array.
struct Decl {
    ty: Ty,
    name: Option<String>,
    array: Option<Vec<String>>,
}

impl Decl {
    /// The type with the array length evaluated (it may name a constant).
    fn resolved(self, consts: &BTreeMap<String, Value>) -> Result<(Ty, Option<String>), String> {
        match self.array {
            None => Ok((self.ty, self.name)),
            Some(len) => match Eval::run(&len, consts)? {
                Value::Int(n) => Ok((Ty::Array(Box::new(self.ty), n), self.name)),
                Value::Float(_) => Err(format!("array length {} is not an integer", len.join(" "))),
            },
        }
    }
}

fn c_decl(toks: &[String]) -> Result<Decl, String> {
    let text = toks.join(" ");
    let (toks, array) = match toks.iter().position(|t| t == "[") {
        Some(open) => {
            let close = toks.iter().rposition(|t| t == "]").ok_or_else(|| format!("unclosed [ in '{text}'"))?;
            (&toks[..open], Some(toks[open + 1..close].to_vec()))
        }
        None => (toks, None),
    };
    let last = toks.last().ok_or("empty declaration")?;
    let named = toks.len() >= 2
        && (last.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_'))
        && !C_TYPE_WORDS.contains(&last.as_str())
        && toks[toks.len() - 2] != "struct"
        && toks[..toks.len() - 1].iter().any(|t| t != "const" && t != "volatile");
    let (type_toks, name) = if named { (&toks[..toks.len() - 1], Some(last.clone())) } else { (toks, None) };
    let first_star = type_toks.iter().position(|t| t == "*").unwrap_or(type_toks.len());
    let base_words: Vec<&str> =
        type_toks[..first_star].iter().map(|s| s.as_str()).filter(|w| *w != "const" && *w != "volatile").collect();
    let mut is_const = type_toks[..first_star].iter().any(|t| t == "const");
    let mut ty = if let Some(p) = c_prim(&base_words) {
        Ty::Prim(p.into())
    } else if let ["struct", n] | [n] = base_words.as_slice() {
        Ty::Named(n.to_string())
    } else {
        return Err(format!("cannot read the type of '{text}'"));
    };
    // Each * points at what is on its left; a const right after a * qualifies that pointer.
    let mut i = first_star;
    while i < type_toks.len() {
        if type_toks[i] != "*" {
            return Err(format!("unexpected '{}' in '{text}'", type_toks[i]));
        }
        ty = Ty::Ptr { mutable: !is_const, to: Box::new(ty) };
        is_const = false;
        i += 1;
        while i < type_toks.len() && (type_toks[i] == "const" || type_toks[i] == "volatile") {
            is_const |= type_toks[i] == "const";
            i += 1;
        }
    }
    Ok(Decl { ty, name, array })
}

/// Splits `toks` at top-level commas (outside (), [], {} and <>).
fn split_commas(toks: &[String]) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new()];
    let mut depth = 0i32;
    for t in toks {
        match t.as_str() {
            "(" | "[" | "{" | "<" => depth += 1,
            ")" | "]" | "}" | ">" => depth -= 1,
            "," if depth == 0 => {
                out.push(Vec::new());
                continue;
            }
            _ => {}
        }
        out.last_mut().unwrap().push(t.clone());
    }
    if out.last().is_some_and(|v| v.is_empty()) {
        out.pop();
    }
    out
}

/// Parameters of a C function: `(void)` is none.
fn c_params(toks: &[String], consts: &BTreeMap<String, Value>) -> Result<Vec<(String, Ty)>, String> {
    if toks.len() == 1 && toks[0] == "void" {
        return Ok(Vec::new());
    }
    split_commas(toks)
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (ty, name) = c_decl(p)?.resolved(consts)?;
            Ok((name.unwrap_or_else(|| format!("#{i}")), ty))
        })
        .collect()
}

fn parse_header(text: &str) -> Api {
    let mut api = Api::default();
    let mut known: BTreeMap<String, Value> = BTreeMap::new();
    let text = strip_c_comments(text).replace("\\\n", " ");
    let mut code = String::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(directive) = t.strip_prefix('#') {
            let directive = directive.trim_start();
            if let Some(rest) = directive.strip_prefix("define") {
                let rest = rest.trim_start();
                let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                let value = rest[name.len()..].trim();
                // FP8_API (attributes) and the include guard carry no value to check.
                if name.starts_with("FP8_") && !value.is_empty() && !value.contains("__") {
                    match Eval::run(&tokenize(value), &known) {
                        Ok(v) => {
                            known.insert(name.clone(), v);
                            api.constants.push((name, v, value.to_string()));
                        }
                        Err(e) => api.problems.push(format!("fp8.h: cannot evaluate #define {name} {value}: {e}")),
                    }
                }
            }
            continue;
        }
        if t == "extern \"C\" {" || t == "}" {
            continue; // the __cplusplus guard's braces
        }
        code.push_str(line);
        code.push('\n');
    }

    // Statements end with ';' outside braces.
    let toks = tokenize(&code);
    let mut statements: Vec<Vec<String>> = vec![Vec::new()];
    let mut depth = 0;
    for t in toks {
        match t.as_str() {
            "{" => depth += 1,
            "}" => depth -= 1,
            ";" if depth == 0 => {
                statements.push(Vec::new());
                continue;
            }
            _ => {}
        }
        statements.last_mut().unwrap().push(t);
    }
    for st in statements.into_iter().filter(|s| !s.is_empty()) {
        let text = st.join(" ");
        let result = parse_c_statement(&st, &known, &mut api);
        if let Err(e) = result {
            api.problems.push(format!("fp8.h: cannot read `{text}`: {e}"));
        }
    }
    api
}

fn parse_c_statement(st: &[String], known: &BTreeMap<String, Value>, api: &mut Api) -> Result<(), String> {
    let text = st.join(" ");
    let s: Vec<&str> = st.iter().map(|s| s.as_str()).collect();
    match s.as_slice() {
        ["FP8_API", ..] => {
            let open = st.iter().position(|t| t == "(").ok_or("no '('")?;
            let close = st.iter().rposition(|t| t == ")").ok_or("no ')'")?;
            if open < 2 || close != st.len() - 1 {
                return Err("not a function declaration".into());
            }
            let name = st[open - 1].clone();
            let ret = c_decl(&st[1..open - 1])?.ty;
            let params = c_params(&st[open + 1..close], known)?;
            api.functions.insert(name, (params, ret, text));
        }
        ["struct", name] => {
            api.opaque.insert(name.to_string());
        }
        ["typedef", "struct", tag, "{", .., "}", alias] => {
            let body = &st[4..st.len() - 2];
            let mut fields = Vec::new();
            for field in body.split(|t| t == ";").filter(|f| !f.is_empty()) {
                let (ty, name) = c_decl(field)?.resolved(known)?;
                fields.push((name.ok_or("a field without a name")?, ty));
            }
            api.structs.insert(tag.to_string(), fields);
            api.aliases.insert(alias.to_string(), Ty::Named(tag.to_string()));
        }
        ["typedef", "struct", tag, alias] => {
            api.opaque.insert(tag.to_string());
            api.aliases.insert(alias.to_string(), Ty::Named(tag.to_string()));
        }
        ["typedef", ..] if s.windows(2).any(|w| w == ["(", "*"]) => {
            // typedef RET (*NAME)(PARAMS)
            let open = s.iter().position(|t| *t == "(").unwrap();
            let name = st.get(open + 2).ok_or("no name")?.clone();
            if s.get(open + 3) != Some(&")") || s.get(open + 4) != Some(&"(") || s.last() != Some(&")") {
                return Err("not a function-pointer typedef".into());
            }
            let ret = c_decl(&st[1..open])?.ty;
            let params = c_params(&st[open + 5..st.len() - 1], known)?;
            api.fn_ptrs
                .insert(name, Ty::FnPtr { params: params.into_iter().map(|p| p.1).collect(), ret: Box::new(ret) });
        }
        ["typedef", .., alias] => {
            let (ty, name) = c_decl(&st[1..])?.resolved(known)?;
            if name.as_deref() != Some(*alias) {
                return Err("not a typedef".into());
            }
            api.aliases.insert(alias.to_string(), ty);
        }
        _ => return Err(format!("unrecognised declaration `{text}`")),
    }
    Ok(())
}

/* ---- the crate ------------------------------------------------------------------------------ */

fn strip_rust_comments_and_attributes(s: &str) -> String {
    let s = strip_c_comments(s); // `//`, `///`, `//!` and `/* */` alike
                                 // Attributes: #[...] and #![...], brackets matched.
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'#' && (s[i..].starts_with("#[") || s[i..].starts_with("#![")) {
            let mut j = i + s[i..].find('[').unwrap();
            let mut depth = 0;
            while j < b.len() {
                match b[j] {
                    b'[' => depth += 1,
                    b']' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            i = j + 1;
        } else {
            let c = s[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn rust_prim(name: &str) -> Option<&'static str> {
    Some(match name {
        "i8" | "c_schar" => "i8",
        "i16" | "c_short" => "i16",
        "i32" | "c_int" => "i32",
        "i64" | "c_longlong" => "i64",
        "u8" | "c_uchar" => "u8",
        "u16" | "c_ushort" => "u16",
        "u32" | "c_uint" => "u32",
        "u64" | "c_ulonglong" => "u64",
        "usize" => "usize",
        "isize" => "isize",
        "f32" | "c_float" => "f32",
        "f64" | "c_double" => "f64",
        "c_char" => "c_char",
        "c_void" => "void",
        _ => return None,
    })
}

/// A Rust type from tokens.
fn rust_type(toks: &[String], consts: &BTreeMap<String, Value>) -> Result<Ty, String> {
    let text = toks.join(" ");
    let s: Vec<&str> = toks.iter().map(|s| s.as_str()).collect();
    match s.as_slice() {
        [] | ["(", ")"] => Ok(Ty::Prim("void".into())),
        ["*", m @ ("mut" | "const"), rest @ ..] => {
            Ok(Ty::Ptr { mutable: *m == "mut", to: Box::new(rust_type(&toks[2..2 + rest.len()], consts)?) })
        }
        ["[", .., "]"] => {
            let inner = &toks[1..toks.len() - 1];
            let semi = inner.iter().rposition(|t| t == ";").ok_or_else(|| format!("no ';' in '{text}'"))?;
            let elem = rust_type(&inner[..semi], consts)?;
            match Eval::run(&inner[semi + 1..], consts)? {
                Value::Int(n) => Ok(Ty::Array(Box::new(elem), n)),
                Value::Float(_) => Err(format!("array length of '{text}' is not an integer")),
            }
        }
        ["Option", "<", .., ">"] => {
            // Option<unsafe extern "C" fn(params) -> ret>
            let inner = &toks[2..toks.len() - 1];
            let fn_at =
                inner.iter().position(|t| t == "fn").ok_or_else(|| format!("not a function pointer: '{text}'"))?;
            let (params, ret) = rust_signature(&inner[fn_at + 1..], consts)?;
            Ok(Ty::FnPtr { params: params.into_iter().map(|p| p.1).collect(), ret: Box::new(ret) })
        }
        _ => {
            // A path: the last segment names it.
            if s.iter().enumerate().any(|(i, t)| if i % 2 == 1 { *t != "::" } else { *t == "::" }) {
                return Err(format!("cannot read the type '{text}'"));
            }
            let last = *s.last().unwrap();
            Ok(match rust_prim(last) {
                Some(p) => Ty::Prim(p.into()),
                None => Ty::Named(last.to_string()),
            })
        }
    }
}

/// `(a: T, b: U) -> R` (the tokens start at '(').
fn rust_signature(toks: &[String], consts: &BTreeMap<String, Value>) -> Result<(Vec<(String, Ty)>, Ty), String> {
    if toks.first().map(|s| s.as_str()) != Some("(") {
        return Err("no parameter list".into());
    }
    let mut depth = 0;
    let mut close = 0;
    for (i, t) in toks.iter().enumerate() {
        match t.as_str() {
            "(" => depth += 1,
            ")" => {
                depth -= 1;
                if depth == 0 {
                    close = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let mut params = Vec::new();
    for (i, p) in split_commas(&toks[1..close]).iter().enumerate() {
        let colon = p.iter().position(|t| t == ":");
        let (name, ty) = match colon {
            Some(c) => (p[..c].join(""), &p[c + 1..]),
            None => (format!("#{i}"), &p[..]),
        };
        params.push((name, rust_type(ty, consts)?));
    }
    let ret = match toks.get(close + 1).map(|s| s.as_str()) {
        Some("->") => rust_type(&toks[close + 2..], consts)?,
        None => Ty::Prim("void".into()),
        Some(t) => return Err(format!("unexpected '{t}' after the parameters")),
    };
    Ok((params, ret))
}

/// Index of the token closing the bracket opened at `open`.
fn matching(toks: &[String], open: usize) -> usize {
    let (o, c) = match toks[open].as_str() {
        "{" => ("{", "}"),
        "(" => ("(", ")"),
        "[" => ("[", "]"),
        _ => unreachable!(),
    };
    let mut depth = 0;
    for (i, t) in toks.iter().enumerate().skip(open) {
        if t == o {
            depth += 1;
        } else if t == c {
            depth -= 1;
            if depth == 0 {
                return i;
            }
        }
    }
    toks.len() - 1
}

fn parse_crate(text: &str) -> Api {
    let mut api = Api::default();
    let mut consts: BTreeMap<String, Value> = BTreeMap::new();
    let toks = tokenize(&strip_rust_comments_and_attributes(text));
    let t = |i: usize| toks.get(i).map(|s| s.as_str()).unwrap_or("");
    let until = |from: usize, end: &str| -> usize {
        let mut depth = 0;
        for (i, tok) in toks.iter().enumerate().skip(from) {
            match tok.as_str() {
                "(" | "[" | "{" | "<" => depth += 1,
                ")" | "]" | "}" | ">" => depth -= 1,
                x if x == end && depth == 0 => return i,
                _ => {}
            }
        }
        toks.len()
    };
    let mut i = 0;
    let mut in_extern: Option<usize> = None; // index of the closing brace of the extern block
    while i < toks.len() {
        if in_extern == Some(i) {
            in_extern = None;
            i += 1;
            continue;
        }
        match (t(i), t(i + 1)) {
            ("macro_rules", "!") => {
                let open = (i..toks.len()).find(|&k| toks[k] == "{").unwrap();
                i = matching(&toks, open) + 1;
            }
            ("opaque", "!") => {
                let close = matching(&toks, i + 2);
                api.opaque.insert(toks[close - 1].clone());
                i = close + 1;
            }
            ("extern", "\"C\"") if t(i + 2) == "{" => {
                in_extern = Some(matching(&toks, i + 2));
                i += 3;
            }
            ("pub", "const") => {
                let name = toks[i + 2].clone();
                let eq = until(i + 3, "=");
                let end = until(eq, ";");
                match Eval::run(&toks[eq + 1..end], &consts) {
                    Ok(v) => {
                        consts.insert(name.clone(), v);
                        api.constants.push((name, v, toks[eq + 1..end].join(" ")));
                    }
                    Err(e) => api.problems.push(format!("fp8-sys: cannot evaluate const {name}: {e}")),
                }
                i = end + 1;
            }
            ("pub", "type") => {
                let name = toks[i + 2].clone();
                let end = until(i + 4, ";");
                match rust_type(&toks[i + 4..end], &consts) {
                    Ok(fp @ Ty::FnPtr { .. }) => {
                        api.fn_ptrs.insert(name, fp);
                    }
                    Ok(ty) => {
                        api.aliases.insert(name, ty);
                    }
                    Err(e) => api.problems.push(format!("fp8-sys: type {name}: {e}")),
                }
                i = end + 1;
            }
            ("pub", "struct") => {
                let name = toks[i + 2].clone();
                if t(i + 3) == "{" {
                    let close = matching(&toks, i + 3);
                    let mut fields = Vec::new();
                    for f in split_commas(&toks[i + 4..close]) {
                        let f: Vec<String> = f.into_iter().filter(|x| x != "pub").collect();
                        let colon = f.iter().position(|x| x == ":").unwrap_or(0);
                        match rust_type(&f[colon + 1..], &consts) {
                            Ok(ty) => fields.push((f[..colon].join(""), ty)),
                            Err(e) => api.problems.push(format!("fp8-sys: struct {name}: {e}")),
                        }
                    }
                    api.structs.insert(name, fields);
                    i = close + 1;
                } else {
                    api.opaque.insert(name);
                    i += 3;
                }
            }
            ("pub", "fn") if in_extern.is_some() => {
                let name = toks[i + 2].clone();
                let end = until(i + 3, ";");
                match rust_signature(&toks[i + 3..end], &consts) {
                    Ok((params, ret)) => {
                        let decl = toks[i..end].join(" ");
                        api.functions.insert(name, (params, ret, decl));
                    }
                    Err(e) => api.problems.push(format!("fp8-sys: fn {name}: {e}")),
                }
                i = end + 1;
            }
            _ => i += 1,
        }
    }
    api
}

/* ---- the comparison ------------------------------------------------------------------------- */

fn compare(h: &Api, r: &Api) -> Vec<String> {
    let mut diffs: Vec<String> = h.problems.iter().chain(&r.problems).cloned().collect();
    let hres = |t: &Ty| resolve(t, &h.aliases);
    let rres = |t: &Ty| resolve(t, &r.aliases);

    // Functions.
    for (name, (hparams, hret, decl)) in &h.functions {
        let Some((rparams, rret, _)) = r.functions.get(name) else {
            diffs.push(format!("function {name} is declared in fp8.h but not in fp8-sys:\n      {decl}"));
            continue;
        };
        if hparams.len() != rparams.len() {
            diffs.push(format!(
                "function {name}: {} parameter(s) in fp8.h, {} in fp8-sys:\n      {decl}",
                hparams.len(),
                rparams.len()
            ));
            continue;
        }
        for (k, ((hn, ht), (rn, rt))) in hparams.iter().zip(rparams).enumerate() {
            let (ht, rt) = (hres(ht), rres(rt));
            if ht != rt {
                diffs.push(format!(
                    "function {name}, parameter {k} ({hn} / {rn}): fp8.h has `{ht}`, fp8-sys has `{rt}`"
                ));
            }
        }
        let (hr, rr) = (hres(hret), rres(rret));
        if hr != rr {
            diffs.push(format!(
                "function {name}: returns `{}` in fp8.h, `{}` in fp8-sys",
                show_ret(&hr),
                show_ret(&rr)
            ));
        }
    }
    for name in r.functions.keys().filter(|n| !h.functions.contains_key(*n)) {
        diffs.push(format!("function {name} is declared in fp8-sys but not in fp8.h"));
    }

    // Constants.
    let rconsts: BTreeMap<&String, &Value> = r.constants.iter().map(|(n, v, _)| (n, v)).collect();
    for (name, hv, text) in &h.constants {
        match rconsts.get(name) {
            None => diffs.push(format!("constant {name} ({text} = {hv}) is defined in fp8.h but not in fp8-sys")),
            Some(rv) => {
                let same = match (hv, *rv) {
                    (Value::Int(a), Value::Int(b)) => a == b,
                    (Value::Float(a), Value::Float(b)) => a == b,
                    _ => false,
                };
                if !same {
                    diffs.push(format!("constant {name}: fp8.h has {hv}, fp8-sys has {rv}"));
                }
            }
        }
    }
    let hconsts: BTreeSet<&String> = h.constants.iter().map(|c| &c.0).collect();
    for (name, v, _) in r.constants.iter().filter(|c| c.0.starts_with("FP8_") && !hconsts.contains(&c.0)) {
        diffs.push(format!("constant {name} = {v} is defined in fp8-sys but not in fp8.h"));
    }

    // Opaque structs and forward declarations.
    for name in &h.opaque {
        if !r.opaque.contains(name) && !r.structs.contains_key(name) {
            diffs.push(format!("struct {name} is declared in fp8.h but fp8-sys has no type {name}"));
        }
    }
    // Typedefs.
    for (alias, target) in &h.aliases {
        match r.aliases.get(alias) {
            None => {
                diffs.push(format!("typedef {alias} (= {target}) is in fp8.h but fp8-sys has no `pub type {alias}`"))
            }
            Some(rt) => {
                let (a, b) = (hres(target), rres(rt));
                if a != b {
                    diffs.push(format!("typedef {alias}: fp8.h has `{a}`, fp8-sys has `{b}`"));
                }
            }
        }
    }
    for (name, hf) in &h.fn_ptrs {
        match r.fn_ptrs.get(name) {
            None => diffs.push(format!(
                "function-pointer typedef {name} is in fp8.h but fp8-sys has no `pub type {name} = Option<unsafe extern \"C\" fn(..)>`"
            )),
            Some(rf) => {
                let (a, b) = (hres(hf), rres(rf));
                if a != b {
                    diffs.push(format!("function-pointer typedef {name}: fp8.h has `{a}`, fp8-sys has `{b}`"));
                }
            }
        }
    }
    // Structs with fields.
    for (name, hfields) in &h.structs {
        let Some(rfields) = r.structs.get(name) else {
            diffs.push(format!("struct {name} is defined in fp8.h but not in fp8-sys"));
            continue;
        };
        let hn: Vec<&str> = hfields.iter().map(|f| f.0.as_str()).collect();
        let rn: Vec<&str> = rfields.iter().map(|f| f.0.as_str()).collect();
        if hn != rn {
            diffs.push(format!(
                "struct {name}: fields differ\n      fp8.h:   {}\n      fp8-sys: {}",
                hn.join(", "),
                rn.join(", ")
            ));
            continue;
        }
        for ((fname, ht), (_, rt)) in hfields.iter().zip(rfields) {
            let (a, b) = (hres(ht), rres(rt));
            if a != b {
                diffs.push(format!("struct {name}, field {fname}: fp8.h has `{a}`, fp8-sys has `{b}`"));
            }
        }
    }
    for name in r.structs.keys().filter(|n| !h.structs.contains_key(*n)) {
        diffs.push(format!("struct {name} has fields in fp8-sys but is not defined in fp8.h"));
    }
    diffs
}

fn apis() -> (Api, Api) {
    let header = header_path();
    let h = parse_header(&read(&header));
    let r = parse_crate(&read(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")));
    // A parser that found nothing would compare nothing: make sure it read the header.
    assert!(h.functions.len() > 100, "read only {} functions from {}", h.functions.len(), header.display());
    assert!(h.constants.len() > 50, "read only {} constants from {}", h.constants.len(), header.display());
    (h, r)
}

#[test]
fn crate_matches_header() {
    let (h, r) = apis();
    let diffs = compare(&h, &r);
    if !diffs.is_empty() {
        panic!(
            "fp8-sys (src/lib.rs) and {} differ in {} place(s):\n  - {}\n",
            header_path().display(),
            diffs.len(),
            diffs.join("\n  - ")
        );
    }
    eprintln!(
        "fp8-sys matches fp8.h: {} functions, {} constants, {} typedefs, {} function-pointer typedefs, {} structs",
        h.functions.len(),
        h.constants.len(),
        h.aliases.len(),
        h.fn_ptrs.len(),
        h.structs.len()
    );
}

/// The comparison itself must catch drift: a header edited in a few ways is reported in each.
#[test]
fn comparison_reports_each_kind_of_drift() {
    let text = read(&header_path());
    let r = parse_crate(&read(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")));
    let edits: &[(&str, &str, &str)] = &[
        ("#define FP8_ERR_SHAPE 3 ", "#define FP8_ERR_SHAPE 33 ", "constant FP8_ERR_SHAPE: fp8.h has 33"),
        ("#define FP8_MAX_DIMS 8", "#define FP8_MAX_DIMS 8\n#define FP8_NEW_THING 0x10u", "constant FP8_NEW_THING"),
        (
            "FP8_API fp8_status_t fp8_model_zero_grad(fp8_model_t *model);",
            "FP8_API fp8_status_t fp8_model_zero_grad(fp8_model_t *model, int32_t flags);",
            "function fp8_model_zero_grad: 2 parameter(s) in fp8.h, 1 in fp8-sys",
        ),
        (
            "FP8_API fp8_status_t fp8_tensor_numel(const fp8_tensor_t *tensor, int64_t *numel);",
            "FP8_API fp8_status_t fp8_tensor_numel(const fp8_tensor_t *tensor, int32_t *numel);",
            "function fp8_tensor_numel, parameter 1",
        ),
        (
            "FP8_API fp8_status_t fp8_model_sync_grads(fp8_model_t *model);",
            "FP8_API fp8_status_t fp8_model_sync_grads(fp8_model_t *model);\nFP8_API void fp8_brand_new(void);",
            "function fp8_brand_new is declared in fp8.h but not in fp8-sys",
        ),
        (
            "  int32_t last_skipped;",
            "  int32_t last_skipped;\n  int32_t extra;",
            "struct fp8_optimizer_stats: fields differ",
        ),
        ("  float alpha; ", "  double alpha; ", "struct fp8_gemm_options, field alpha"),
        ("typedef int32_t fp8_norm_t;", "typedef int64_t fp8_norm_t;", "typedef fp8_norm_t"),
    ];
    for (from, to, expected) in edits {
        assert!(text.contains(from), "the header no longer contains {from:?}: update this test");
        let h = parse_header(&text.replacen(from, to, 1));
        let diffs = compare(&h, &r);
        assert!(
            diffs.iter().any(|d| d.contains(expected)),
            "editing {from:?} -> {to:?} was not reported as {expected:?}; got {diffs:#?}"
        );
    }
}

/* ---- layout against a C compiler ------------------------------------------------------------ */

/// (struct, size, align, [(field, offset, size)]) of the Rust structs. The field lists are checked
/// against the header below, so this list cannot go stale unnoticed.
macro_rules! rust_layouts {
    ($($s:ident { $($f:ident),* $(,)? })*) => {
        vec![$((
            stringify!($s),
            std::mem::size_of::<fp8_sys::$s>(),
            std::mem::align_of::<fp8_sys::$s>(),
            vec![$((
                stringify!($f),
                std::mem::offset_of!(fp8_sys::$s, $f),
                field_size(|s: &fp8_sys::$s| &s.$f),
            )),*],
        )),*]
    };
}

fn field_size<S, F>(_: fn(&S) -> &F) -> usize {
    std::mem::size_of::<F>()
}

type Layout = (&'static str, usize, usize, Vec<(&'static str, usize, usize)>);

fn rust_layouts() -> Vec<Layout> {
    rust_layouts! {
        fp8_device_info { struct_size, device, name, compute_capability, multiprocessor_count, total_memory_bytes,
            fp8_gemm, fp8_block_scaling, fp8_nccl_reduction, nccl_version, cublaslt_version }
        fp8_scaling_info { struct_size, scale, scale_inv, amax, amax_history_len, reserved, update_count,
            nonfinite_count }
        fp8_gemm_options { struct_size, alpha, accumulate, fast_accumulation }
        fp8_convert_options { struct_size, to_fp8, linear, norm, activation }
        fp8_layer_report { struct_size, kind, converted, fprop, dgrad, wgrad, fp8_calls, fallback_calls, reason,
            scaling, reserved }
        fp8_optimizer_stats { struct_size, steps, skipped_steps, last_skipped, last_grad_norm, parameters,
            state_bytes, opt_level, training_bytes }
        fp8_comm_id { bytes }
    }
}

#[test]
fn layout_matches_c() {
    let (h, _) = apis();
    let layouts = rust_layouts();
    // The list above names every struct of the header with its fields in order.
    let listed: BTreeMap<&str, Vec<&str>> = layouts.iter().map(|l| (l.0, l.3.iter().map(|f| f.0).collect())).collect();
    let header: BTreeMap<&str, Vec<&str>> =
        h.structs.iter().map(|(n, f)| (n.as_str(), f.iter().map(|f| f.0.as_str()).collect())).collect();
    assert_eq!(listed, header, "rust_layouts! in tests/header.rs must list every struct of fp8.h and its fields");

    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let include = header_path().parent().unwrap().to_path_buf();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fp8_layout");
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = String::from("#include <fp8.h>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n");
    for (s, fields) in &h.structs {
        c += &format!("  printf(\"{s} %zu %zu\\n\", sizeof(struct {s}), _Alignof(struct {s}));\n");
        for (f, _) in fields {
            c += &format!(
                "  printf(\"{s}.{f} %zu %zu\\n\", offsetof(struct {s}, {f}), sizeof(((struct {s} *)0)->{f}));\n"
            );
        }
    }
    c += "  return 0;\n}\n";
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, c).unwrap();
    let built =
        std::process::Command::new(&cc).args(["-std=c11", "-I"]).arg(&include).arg(&src).arg("-o").arg(&exe).output();
    match built {
        Err(e) => {
            eprintln!("SKIP layout_matches_c: no C compiler ({cc}: {e})");
            return;
        }
        Ok(o) if !o.status.success() => {
            panic!("{cc} failed on {}:\n{}", src.display(), String::from_utf8_lossy(&o.stderr))
        }
        Ok(_) => {}
    }
    let out = std::process::Command::new(&exe).output().expect("run the layout program");
    let c_layout: BTreeMap<String, (usize, usize)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0].to_string(), (w[1].parse().unwrap(), w[2].parse().unwrap()))
        })
        .collect();
    let mut diffs = Vec::new();
    for (s, size, align, fields) in &layouts {
        if c_layout[*s] != (*size, *align) {
            diffs.push(format!("{s}: C size/align {:?}, Rust ({size}, {align})", c_layout[*s]));
        }
        for (f, offset, fsize) in fields {
            let key = format!("{s}.{f}");
            if c_layout[&key] != (*offset, *fsize) {
                diffs.push(format!("{key}: C offset/size {:?}, Rust ({offset}, {fsize})", c_layout[&key]));
            }
        }
    }
    assert!(diffs.is_empty(), "struct layouts differ from {cc}'s:\n  - {}", diffs.join("\n  - "));
}
